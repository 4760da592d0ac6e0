"""Bearer-token (JWT) authentication of the HTTP gateway: who is calling, for which tenant, with which models.

Owns the verification of a request's `Authorization: Bearer <JWT>` header into a `Principal` (tenant, user, models
it may use), the per-model authorization check, and the minting of HS256 development tokens (`rackflow token`).
Keys come from the environment (HS256 secret, named by `gateway.auth.secret_env`) or a PEM file (RS256 public key),
read once at construction. It must never log or echo a token or a secret, never accept an algorithm other than the
configured one (no `none`, no HS/RS confusion), and never decide anything about a request beyond who may send it.

Claims: `sub` (user id, required), `exp` (required), `tenant` (required, string), optional `models` (list of the
model names the token may use; absent: all), `model` (the default model when a request names none), `priority`
(`interactive` or `batch`: the highest class the token's requests may run in, pipeline/priority.py) and `tpm` (the
tenant's tokens-per-minute limit, workers/stores/rate_limit.py); `aud` and `iss` are checked when configured.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from pipeline.config import AuthConfig, ConfigError, RackflowConfig
from pipeline.errors import RackflowError
from pipeline.priority import CLAIM, PriorityError, parse_class

log = logging.getLogger(__name__)

_ALGORITHMS = {"hs256": "HS256", "rs256": "RS256"}
_MIN_HS256_SECRET_BYTES = 32
_MAX_TOKEN_CHARS = 16_384


class AuthError(RackflowError):
    """The caller is not authenticated (401) or not allowed to do this (403); the message says what to fix."""

    def __init__(self, message: str, status: int = 401, code: str = "invalid_token") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class AuthSetupError(ConfigError):
    """The gateway cannot verify tokens as configured (missing secret or key); raised at start, not per request."""


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant it is billed to and isolated in, the user, and the models it may use."""

    tenant: str
    sub: str
    models: tuple[str, ...] | None = None
    """Models the token may use; None: every model."""
    default_model: str | None = None
    """Model used when the request names none (the token's `model` claim)."""
    priority: int | None = None
    """The highest priority class its requests may run in (the `priority` claim); None: any."""
    tpm: int | None = None
    """Its tenant's tokens-per-minute limit (the `tpm` claim); None: the tenant's configured one, if any."""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def require_model(self, model: str) -> None:
        """AuthError 403 when the token does not allow `model`."""
        if not self.allows(model):
            allowed = ", ".join(self.models or ()) or "none"
            raise AuthError(
                f"this token does not allow model {model!r}; allowed: {allowed} (ask for a token whose `models` "
                "claim includes it)",
                403, "model_not_allowed",
            )


class Authenticator:
    """Verifies bearer tokens for one gateway; `enabled` is False when auth is off (mode `none` or `--no-auth`)."""

    def __init__(self, auth: AuthConfig, no_auth: bool) -> None:
        self.auth = auth
        self.enabled = not no_auth and auth.mode != "none"
        self._key: Any = None
        self._algorithm = _ALGORITHMS.get(auth.mode, "")
        if not self.enabled:
            log.warning(
                "JWT auth is OFF: every request is accepted as tenant %s (local runs only)", auth.default_tenant
            )
            return
        if auth.mode == "hs256":
            secret = os.environ.get(auth.secret_env)
            if not secret:
                raise AuthSetupError(
                    f"set {auth.secret_env} (gateway.auth.secret_env) to the HS256 secret, or run with --no-auth "
                    "for local runs"
                )
            if len(secret.encode()) < _MIN_HS256_SECRET_BYTES:
                log.warning("%s is shorter than %d bytes; use a longer random secret", auth.secret_env,
                            _MIN_HS256_SECRET_BYTES)
            self._key = secret
        else:
            self._key = _load_public_key(auth.public_key_file)
        log.info("JWT auth: %s%s%s", self._algorithm, f", audience {auth.audience}" if auth.audience else "",
                 f", issuer {auth.issuer}" if auth.issuer else "")

    def verify(self, authorization_header: str | None, user: str | None = None) -> Principal:
        """The Principal of a request from its Authorization header; AuthError 401 when it is missing or invalid.

        With auth off every request is accepted as `auth.default_tenant`, as user `user` (the request's own
        `user` field, when the caller has it) or `anonymous`.
        """
        if not self.enabled:
            return Principal(tenant=self.auth.default_tenant, sub=user or "anonymous")
        token = _bearer(authorization_header)
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=[self._algorithm],
                options={"require": ["exp", "sub"]},
                leeway=self.auth.leeway_s,
                audience=self.auth.audience,
                issuer=self.auth.issuer,
            )
        except jwt.ExpiredSignatureError:
            raise AuthError("the token has expired; get a new one (e.g. `rackflow token`)", 401,
                            "token_expired") from None
        except jwt.InvalidSignatureError:
            raise AuthError("the token's signature is invalid (signed with another secret or key)", 401,
                            "invalid_signature") from None
        except jwt.MissingRequiredClaimError as e:
            raise AuthError(f"the token is missing the required claim {e.claim!r}", 401, "missing_claim") from None
        except jwt.InvalidAudienceError:
            raise AuthError(f"the token's audience (aud) is wrong; this gateway requires {self.auth.audience!r}",
                            401, "invalid_audience") from None
        except jwt.InvalidIssuerError:
            raise AuthError(f"the token's issuer (iss) is wrong; this gateway requires {self.auth.issuer!r}",
                            401, "invalid_issuer") from None
        except jwt.ImmatureSignatureError:
            raise AuthError("the token is not valid yet (nbf/iat in the future); check the issuer's clock", 401,
                            "token_not_yet_valid") from None
        except jwt.InvalidAlgorithmError:
            raise AuthError(f"the token is not signed with {self._algorithm}, the only algorithm this gateway "
                            "accepts", 401, "invalid_algorithm") from None
        except jwt.InvalidTokenError as e:
            raise AuthError(f"the bearer token is not a valid JWT ({e})", 401, "invalid_token") from None
        return _principal(claims)


def _bearer(header: str | None) -> str:
    if not header or not header.strip():
        raise AuthError(
            "missing bearer token: send `Authorization: Bearer <JWT>` (mint a dev token with `rackflow token`)",
            401, "missing_token",
        )
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise AuthError("the Authorization header must be `Bearer <JWT>`", 401, "invalid_token")
    if len(token) > _MAX_TOKEN_CHARS:
        raise AuthError(f"the bearer token is longer than {_MAX_TOKEN_CHARS} characters", 401, "invalid_token")
    return token


def _principal(claims: dict[str, Any]) -> Principal:
    tenant = claims.get("tenant")
    if tenant is None:
        raise AuthError("the token is missing the required claim 'tenant'", 401, "missing_claim")
    if not isinstance(tenant, str) or not tenant.strip():
        raise AuthError("the token's 'tenant' claim must be a non-empty string", 401, "invalid_claim")
    sub = claims["sub"]
    if not isinstance(sub, str) or not sub:
        raise AuthError("the token's 'sub' claim must be a non-empty string", 401, "invalid_claim")
    models = claims.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise AuthError("the token's 'models' claim must be a list of model names", 401, "invalid_claim")
    default_model = claims.get("model")
    if default_model is not None and not isinstance(default_model, str):
        raise AuthError("the token's 'model' claim must be a model name (string)", 401, "invalid_claim")
    try:
        priority = parse_class(claims[CLAIM], "the token's 'priority' claim") if CLAIM in claims else None
    except PriorityError as e:
        raise AuthError(str(e), 401, "invalid_claim") from None
    tpm = claims.get("tpm")
    if tpm is not None and (type(tpm) is not int or tpm < 1):
        raise AuthError("the token's 'tpm' claim must be an integer >= 1 (tokens per minute)", 401, "invalid_claim")
    return Principal(tenant=tenant, sub=sub, models=tuple(models) if models is not None else None,
                     default_model=default_model or None, priority=priority, tpm=tpm)


def _load_public_key(path: str | None) -> Any:
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    if not path:
        raise AuthSetupError(
            "gateway.auth.mode is rs256 but gateway.auth.public_key_file is not set; give the PEM file of the "
            "RS256 public key, or run with --no-auth for local runs"
        )
    try:
        key = load_pem_public_key(Path(path).read_bytes())
    except OSError as e:
        raise AuthSetupError(f"cannot read gateway.auth.public_key_file {path}: {e.strerror}") from None
    except ValueError as e:
        raise AuthSetupError(f"gateway.auth.public_key_file {path} is not a PEM public key: {e}") from None
    if not isinstance(key, RSAPublicKey):
        raise AuthSetupError(f"gateway.auth.public_key_file {path} holds a {type(key).__name__}, not an RSA key")
    return key


def mint_token(
    auth: AuthConfig,
    *,
    tenant: str,
    sub: str,
    models: Sequence[str] | None = None,
    default_model: str | None = None,
    ttl_s: int = 3600,
    now: float | None = None,
    priority: str | None = None,
    tpm: int | None = None,
) -> str:
    """An HS256 token for this gateway's config (development and tests; production tokens come from an issuer)."""
    if auth.mode != "hs256":
        raise AuthError(
            f"gateway.auth.mode is {auth.mode}: minting is for HS256 dev tokens only"
            + (" (RS256 tokens need the issuer's private key)" if auth.mode == "rs256" else "")
        )
    secret = os.environ.get(auth.secret_env)
    if not secret:
        raise AuthError(f"set {auth.secret_env} (gateway.auth.secret_env) to the gateway's HS256 secret")
    if not tenant:
        raise AuthError("tenant must not be empty")
    if not sub:
        raise AuthError("sub (user id) must not be empty")
    if ttl_s < 1:
        raise AuthError(f"ttl_s must be >= 1, got {ttl_s}")
    iat = int(now if now is not None else time.time())
    claims: dict[str, Any] = {"sub": sub, "tenant": tenant, "iat": iat, "exp": iat + ttl_s}
    if models is not None:
        claims["models"] = list(models)
    if default_model:
        claims["model"] = default_model
    if priority:
        try:
            parse_class(priority, "priority")
        except PriorityError as e:
            raise AuthError(str(e)) from None
        claims[CLAIM] = priority
    if tpm is not None:
        if tpm < 1:
            raise AuthError(f"tpm must be >= 1 tokens per minute, got {tpm}")
        claims["tpm"] = tpm
    if auth.audience:
        claims["aud"] = auth.audience
    if auth.issuer:
        claims["iss"] = auth.issuer
    return jwt.encode(claims, secret, algorithm="HS256")


def gateway_auth_available(config: RackflowConfig) -> bool:
    """Whether the gateway can verify tokens here: the HS256 secret is in its environment variable, or the RS256
    public key file exists. `rackflow up` runs the gateway without auth (and says so) when it cannot."""
    auth = config.gateway.auth
    if auth.mode == "hs256":
        return bool(os.environ.get(auth.secret_env))
    if auth.mode == "rs256":
        return bool(auth.public_key_file and Path(auth.public_key_file).exists())
    return False

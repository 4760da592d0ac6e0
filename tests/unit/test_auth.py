"""Bearer-token auth of the gateway, pure: HS256 and RS256 verification, every way a token is refused, the
models claim, auth off, and minting dev tokens. Keys are generated in the test; nothing talks to a server."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from pipeline.config import AuthConfig, ConfigError
from workers.gateway.auth import Authenticator, AuthError, Principal, mint_token

SECRET = "test-secret-0123456789abcdef-0123456789"
ENV = "RACKFLOW_TEST_JWT_SECRET"


@pytest.fixture
def hs256(monkeypatch: pytest.MonkeyPatch) -> AuthConfig:
    monkeypatch.setenv(ENV, SECRET)
    return AuthConfig(mode="hs256", secret_env=ENV)


def _token(claims: dict[str, object], key: object = SECRET, alg: str = "HS256") -> str:
    return jwt.encode(claims, key, algorithm=alg)  # type: ignore[arg-type]


def _claims(**kw: object) -> dict[str, object]:
    now = int(time.time())
    c: dict[str, object] = {"sub": "u1", "tenant": "acme", "iat": now, "exp": now + 60}
    c.update(kw)
    return {k: v for k, v in c.items() if v is not None}


def _refused(authn: Authenticator, header: str | None) -> AuthError:
    with pytest.raises(AuthError) as info:
        authn.verify(header)
    assert info.value.status == 401
    return info.value


def test_valid_hs256_token_gives_its_principal(hs256: AuthConfig) -> None:
    authn = Authenticator(hs256, no_auth=False)
    p = authn.verify(f"Bearer {_token(_claims())}")
    assert p == Principal(tenant="acme", sub="u1", models=None, default_model=None)
    assert authn.enabled and p.allows("anything")


def test_minted_token_round_trips_with_models_and_default_model(hs256: AuthConfig) -> None:
    tok = mint_token(hs256, tenant="acme", sub="alice", models=["qwen2-7b"], default_model="qwen2-7b", ttl_s=60)
    p = Authenticator(hs256, no_auth=False).verify(f"bearer {tok}")
    assert p == Principal(tenant="acme", sub="alice", models=("qwen2-7b",), default_model="qwen2-7b")
    assert p.allows("qwen2-7b") and not p.allows("qwen2-72b")
    p.require_model("qwen2-7b")
    with pytest.raises(AuthError) as info:
        p.require_model("qwen2-72b")
    assert info.value.status == 403 and "qwen2-72b" in str(info.value) and "qwen2-7b" in str(info.value)


def test_minted_token_carries_its_class_ceiling_and_its_tenants_token_limit(hs256: AuthConfig) -> None:
    tok = mint_token(hs256, tenant="acme", sub="bot", priority="batch", tpm=90_000, ttl_s=60)
    p = Authenticator(hs256, no_auth=False).verify(f"Bearer {tok}")
    assert (p.priority, p.tpm) == (1, 90_000)
    with pytest.raises(AuthError, match="allowed: interactive, batch"):
        mint_token(hs256, tenant="acme", sub="bot", priority="urgent")


def test_expired_token_says_expired(hs256: AuthConfig) -> None:
    old = int(time.time()) - 3600
    e = _refused(Authenticator(hs256, no_auth=False), f"Bearer {_token(_claims(iat=old, exp=old + 60))}")
    assert "expired" in str(e) and e.code == "token_expired"


def test_expiry_within_leeway_is_accepted(hs256: AuthConfig) -> None:
    now = int(time.time())
    tok = _token(_claims(iat=now - 60, exp=now - 2))
    assert Authenticator(hs256, no_auth=False).verify(f"Bearer {tok}").tenant == "acme"  # leeway 5 s


def test_minted_token_with_past_now_is_expired(hs256: AuthConfig) -> None:
    tok = mint_token(hs256, tenant="acme", sub="u", ttl_s=10, now=time.time() - 100)
    assert "expired" in str(_refused(Authenticator(hs256, no_auth=False), f"Bearer {tok}"))


def test_bad_signature_says_signature(hs256: AuthConfig) -> None:
    e = _refused(Authenticator(hs256, no_auth=False), f"Bearer {_token(_claims(), key='another-secret' * 4)}")
    assert "signature" in str(e) and "expired" not in str(e) and e.code == "invalid_signature"


@pytest.mark.parametrize("header", [None, "", "   "])
def test_missing_header_says_missing(hs256: AuthConfig, header: str | None) -> None:
    e = _refused(Authenticator(hs256, no_auth=False), header)
    assert "missing" in str(e) and "Bearer" in str(e) and e.code == "missing_token"


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "token-without-scheme"])
def test_malformed_header(hs256: AuthConfig, header: str) -> None:
    assert "Bearer <JWT>" in str(_refused(Authenticator(hs256, no_auth=False), header))


def test_garbage_token_is_invalid(hs256: AuthConfig) -> None:
    e = _refused(Authenticator(hs256, no_auth=False), "Bearer not.a.jwt")
    assert "not a valid JWT" in str(e)


@pytest.mark.parametrize("claim", ["tenant", "sub", "exp"])
def test_missing_claim_is_named(hs256: AuthConfig, claim: str) -> None:
    e = _refused(Authenticator(hs256, no_auth=False), f"Bearer {_token(_claims(**{claim: None}))}")
    assert f"'{claim}'" in str(e) and "missing" in str(e)


@pytest.mark.parametrize(
    ("claims", "word"),
    [({"tenant": 5}, "tenant"), ({"tenant": ""}, "tenant"), ({"models": "qwen2-7b"}, "models"),
     ({"models": [1]}, "models"), ({"model": ["x"]}, "model"), ({"priority": "urgent"}, "priority"),
     ({"tpm": "100"}, "tpm"), ({"tpm": 0}, "tpm")],
)
def test_malformed_claims(hs256: AuthConfig, claims: dict[str, object], word: str) -> None:
    e = _refused(Authenticator(hs256, no_auth=False), f"Bearer {_token(_claims(**claims))}")
    assert f"'{word}'" in str(e)


def test_wrong_audience_and_issuer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, SECRET)
    auth = AuthConfig(mode="hs256", secret_env=ENV, audience="rackflow", issuer="https://issuer.example")
    authn = Authenticator(auth, no_auth=False)
    good = _claims(aud="rackflow", iss="https://issuer.example")
    assert authn.verify(f"Bearer {_token(good)}").tenant == "acme"
    assert "audience" in str(_refused(authn, f"Bearer {_token({**good, 'aud': 'other'})}"))
    assert "'aud'" in str(_refused(authn, f"Bearer {_token({k: v for k, v in good.items() if k != 'aud'})}"))
    assert "issuer" in str(_refused(authn, f"Bearer {_token({**good, 'iss': 'https://evil.example'})}"))
    # minted tokens carry the configured audience and issuer
    assert authn.verify(f"Bearer {mint_token(auth, tenant='t', sub='s')}").tenant == "t"


def test_rs256_with_generated_key_pair(tmp_path: Path) -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "pub.pem").write_bytes(pem)
    authn = Authenticator(AuthConfig(mode="rs256", public_key_file=str(tmp_path / "pub.pem")), no_auth=False)
    p = authn.verify(f"Bearer {_token(_claims(models=['qwen2-7b']), key=private, alg='RS256')}")
    assert p.tenant == "acme" and p.models == ("qwen2-7b",)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert "signature" in str(_refused(authn, f"Bearer {_token(_claims(), key=other, alg='RS256')}"))
    # an HS256 token (e.g. signed with the public key as an HMAC secret) is refused: no algorithm confusion
    assert "RS256" in str(_refused(authn, f"Bearer {_token(_claims(), key='x' * 40)}"))


def test_rs256_needs_a_readable_public_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="public_key_file"):
        Authenticator(AuthConfig(mode="rs256"), no_auth=False)
    with pytest.raises(ConfigError, match="cannot read"):
        Authenticator(AuthConfig(mode="rs256", public_key_file=str(tmp_path / "nope.pem")), no_auth=False)
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        Authenticator(AuthConfig(mode="rs256", public_key_file=str(tmp_path / "bad.pem")), no_auth=False)


def test_hs256_without_secret_fails_at_start_and_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError) as info:
        Authenticator(AuthConfig(mode="hs256", secret_env=ENV), no_auth=False)
    assert ENV in str(info.value) and "--no-auth" in str(info.value)


def test_auth_off_accepts_everyone_as_default_tenant_and_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)  # no secret needed when auth is off
    with caplog.at_level(logging.WARNING, logger="workers.gateway.auth"):
        authn = Authenticator(AuthConfig(mode="hs256", secret_env=ENV, default_tenant="dev"), no_auth=True)
    assert [r.getMessage() for r in caplog.records] == [
        "JWT auth is OFF: every request is accepted as tenant dev (local runs only)"
    ]
    assert not authn.enabled
    assert authn.verify(None) == Principal(tenant="dev", sub="anonymous", models=None, default_model=None)
    assert authn.verify("Bearer whatever", user="bob").sub == "bob"
    assert not Authenticator(AuthConfig(mode="none"), no_auth=False).enabled


def test_mint_token_errors(monkeypatch: pytest.MonkeyPatch, hs256: AuthConfig) -> None:
    with pytest.raises(AuthError, match=r"HS256 dev tokens only.*private key"):
        mint_token(AuthConfig(mode="rs256", public_key_file="x.pem"), tenant="t", sub="s")
    with pytest.raises(AuthError, match="ttl_s"):
        mint_token(hs256, tenant="t", sub="s", ttl_s=0)
    with pytest.raises(AuthError, match="tenant"):
        mint_token(hs256, tenant="", sub="s")
    monkeypatch.delenv(ENV)
    with pytest.raises(AuthError, match=ENV):
        mint_token(hs256, tenant="t", sub="s")


def test_minted_claims(hs256: AuthConfig) -> None:
    tok = mint_token(hs256, tenant="acme", sub="alice", ttl_s=120, now=1_000_000)
    claims = jwt.decode(tok, SECRET, algorithms=["HS256"], options={"verify_exp": False, "verify_iat": False})
    assert claims == {"sub": "alice", "tenant": "acme", "iat": 1_000_000, "exp": 1_000_120}

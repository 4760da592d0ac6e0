"""The baseline of `rackflow bench pipeline`: what a user would build instead of our streams, one Celery task per
request (Redis/Valkey broker and result backend), doing the same trivial amount of "inference" work as the zero-time
`sim` engine (placeholder tokens). Started by the benchmark as a real `celery worker` process."""

from __future__ import annotations

import os

from celery import Celery

from pipeline.routing.hashring import stable_hash64

BROKER = os.environ.get("RACKFLOW_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("rackflow_bench", broker=BROKER, backend=BROKER)
app.conf.update(
    task_serializer="msgpack", result_serializer="msgpack", accept_content=["msgpack", "json"],
    task_acks_late=True, worker_prefetch_multiplier=16, result_expires=600, broker_connection_retry_on_startup=True,
)


@app.task(name="rackflow_bench.generate")  # type: ignore[untyped-decorator]
def generate(request_id: str, prompt_tokens: int, max_tokens: int) -> dict[str, object]:
    tokens = [stable_hash64(f"{request_id}:{i}") % 152064 for i in range(max_tokens)]
    return {"request_id": request_id, "in_tokens": prompt_tokens, "out_tokens": len(tokens), "token_ids": tokens}

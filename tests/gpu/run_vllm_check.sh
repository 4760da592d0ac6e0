#!/usr/bin/env bash
# On a GPU machine with vLLM installed: start a rackflow worker with the vllm engine on a small local model, run a
# batch through the real pipeline, print tokens/s. Usage: tests/gpu/run_vllm_check.sh /path/to/small-model [N]
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR [REQUESTS]}
N=${2:-64}
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import vllm, torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('vllm', vllm.__version__, 'gpu', torch.cuda.get_device_name(0))"
RACKFLOW_VLLM_TEST_MODEL="$MODEL" "$PY" -m pytest -q tests/gpu -p no:cacheprovider
cfg=$(mktemp --suffix .yaml)
cat > "$cfg" <<YAML
cluster:
  racks:
    - {name: r0, node_count: 1, node: {gpu: h100-80gb, tp: 1, models: [qwen2-7b]}}
policies:
  worker: {engine: vllm, vllm: {model: "$MODEL", gpu_memory_utilization: 0.8, kv_connector: null}}
YAML
"$PY" - "$cfg" "$N" <<'PYEOF'
import asyncio, sys, time, uuid, tempfile
from pathlib import Path
from pipeline.config import DEFAULT_CONFIG_DIR, load_config
from pipeline.profiling import ProfileInput
from workers.local.services import EmbeddedServices
from workers.local.launcher import ClusterProcesses, wait_cluster_ready
from workers.shell.runtime import WALL
from tests.integration import harness

cfg_path, n = Path(sys.argv[1]), int(sys.argv[2])
config = load_config(DEFAULT_CONFIG_DIR, [cfg_path])
tmp = Path(tempfile.mkdtemp())
svc = EmbeddedServices(tmp / "svc"); ep = svc.start()
procs = ClusterProcesses(config, ep.redis_url, ep.etcd_url, tmp / "logs", ["--config", str(cfg_path)], engine="vllm")
procs.start()
try:
    asyncio.run(wait_cluster_ready(config, ep.redis_url, ep.etcd_url, 600))
    items = [ProfileInput(str(uuid.uuid4()), "gpu", f"u{i}", "qwen2-7b", WALL.now_ms(),
                          prompt=f"Write a short story number {i} about a GPU cluster.", max_tokens=128) for i in range(n)]
    t = time.perf_counter()
    sent = asyncio.run(harness.submit(config, ep.redis_url, items))
    got, counts = asyncio.run(harness.wait_results(ep.redis_url, {r.request_id for r in sent}, 600))
    wall = time.perf_counter() - t
    toks = sum(e.out_tokens for e in got.values())
    print(f"vllm check: {len(got)}/{n} requests, {toks} tokens in {wall:.1f}s = {toks / wall:.0f} tokens/s, "
          f"duplicates={sum(c - 1 for c in counts.values())}")
finally:
    procs.stop(); svc.stop()
PYEOF

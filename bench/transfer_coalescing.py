"""How well real PD transfers coalesce: descriptors per KV transfer through a tiny-model 1P1D pair.

    python bench/transfer_coalescing.py [--page-size 1 16] [--waves 4] [--requests 24]

Waves of concurrent requests (random prompts 20-200 tokens, 4-40 outputs) churn both pools;
prefill's kv_transfer counters then give descriptors per transfer and bytes per descriptor.
Each descriptor costs ~3 us on UCX CMA here (bench/transfer.py), so fewer is faster.
Last line: RESULT {json} with desc_per_transfer_page<N> for each page size.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.model.testing import build_tiny_checkpoint  # noqa: E402
from tests.pd.pd_procs import start_pair  # noqa: E402


def measure(model_dir: Path, page_size: int, waves: int, requests: int) -> dict[str, float]:
    ps = str(page_size)
    pair = start_pair(model_dir, ["--page-size", ps, "--chunked-prefill-size", "64", "--max-total-tokens", "4096"],
                      ["--page-size", ps, "--max-total-tokens", "4096"])
    try:
        rng = random.Random(0)
        for _ in range(waves):
            pair.run([pair.body([rng.randrange(3, 200) for _ in range(rng.randrange(20, 200))], rng.randrange(4, 40))
                      for _ in range(requests)])
        transfers = pair.prefill.stat("kv_transfer_transfers") or 0.0
        descs = pair.prefill.stat("kv_transfer_descriptors") or 0.0
        nbytes = pair.prefill.stat("kv_transfer_bytes") or 0.0
    finally:
        pair.stop()
    return {"transfers": transfers, "descriptors": descs, "desc_per_transfer": descs / max(transfers, 1.0),
            "bytes_per_desc": nbytes / max(descs, 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    a = ap.parse_args()
    model_dir = Path(tempfile.mkdtemp(prefix="coalesce-")) / "tiny"
    build_tiny_checkpoint(model_dir, "llama")
    result: dict[str, float] = {}
    for ps in a.page_size:
        m = measure(model_dir, ps, a.waves, a.requests)
        print(f"page_size {ps:3d}: {m['transfers']:.0f} transfers, {m['desc_per_transfer']:.1f} descriptors each, "
              f"{m['bytes_per_desc']:.0f} B per descriptor", flush=True)
        result[f"desc_per_transfer_page{ps}"] = round(m["desc_per_transfer"], 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

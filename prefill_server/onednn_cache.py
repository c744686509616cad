"""A small oneDNN primitive cache for the prefill engine (issue 41 item 6).

oneDNN (torch's CPU linears, prepacked in common/model/packed_linear.py) keeps one compiled
primitive per linear and input row count, up to ONEDNN_PRIMITIVE_CACHE_CAPACITY (1,024 by
default). Prefill runs chunks of hundreds of different lengths, so that cache fills with
primitives used once and the engine's RSS grows ~2.5 MiB per request until it is full; decode
runs a few bucketed batch sizes and never fills it. A prefill forward needs only a handful of
primitives (one per weight shape: every layer shares them), so a small cache costs a primitive
build per new chunk length. Measured (bench/prefill_memory.py, README's Status section): the
slope drops from ~2.7 to ~1.7 MiB per request at ~3% of prefill tokens/s; the rest went away with
bucketed linear rows (--cpu-prefill-row-bucket, common/model/packed_linear.py: ~0.1 MiB per request).

ideep, torch's C++ layer over oneDNN, keeps a second cache of its own, keyed by the same shapes,
of up to LRU_CACHE_CAPACITY (1,024) entries that hold their primitives alive past oneDNN's
eviction: ~0.25-0.4 MiB each for this model's linears. Prefill batches of several requests reach
~70 row buckets x 4 weight shapes, so the soak's prefill engine still grew ~10 MiB per 1,000
requests as rarer batch sizes filled it. LRU_CACHE_CAPACITY=16 bounds it too: 152 shapes cost
+19 MiB of C heap instead of +57 MiB, with no measurable loss of linear throughput (a forward
needs ~4 shapes at a time; README, Reliability).

The prefill frontend sets the variables before it spawns the engine, so the engine process
starts with it (before torch creates its first primitive, when oneDNN reads it). A value the
user already exported wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ENV_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
PREFILL_CAPACITY = 16
IDEEP_ENV_VAR = "LRU_CACHE_CAPACITY"  # ideep's computation cache
IDEEP_CAPACITY = 16


def limit_primitive_cache(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets both capacities for processes started from here on unless set; returns oneDNN's in effect."""
    environ.setdefault(IDEEP_ENV_VAR, str(IDEEP_CAPACITY))
    return environ.setdefault(ENV_VAR, str(PREFILL_CAPACITY))

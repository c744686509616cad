"""The aux row's byte format (no torch, no NIXL: the router and the HTTP layer read its limits).

    row layout (little endian), ROW_BYTES = 384, a multiple of 64
    +--------+--------+-------------+---------------+---------+-------------+---------+---------+
    | magic  | room   | first_token | cached_tokens | logprob | has_logprob | num_top | padding |
    | u64 0  | i64 8  | i64 16      | i64 24        | f64 32  | u8 40       | u8 41   | 42..47  |
    +--------+--------+-------------+---------------+---------+-------------+---------+---------+
    | top logprobs of the first token: MAX_TOP_LOGPROBS x (token i64, logprob f64) | 48..367 |
    +------------------------------------------------------------------------------+---------+

MAX_TOP_LOGPROBS bounds every top-logprobs request the system accepts: in PD mode the first
token's top logprobs ride in this row, so no API may ask for more than the row holds.
"""

from __future__ import annotations

import struct

MAX_TOP_LOGPROBS = 20
ROW_BYTES = 384
ROW_HEAD = struct.Struct("<QqqqdBB6x")
ROW_TOP_ENTRY = struct.Struct("<qd")
ROW_MAGIC = 0x4B56_5852_4F57_0002  # "KVXROW" v2

assert ROW_HEAD.size + MAX_TOP_LOGPROBS * ROW_TOP_ENTRY.size <= ROW_BYTES and ROW_BYTES % 64 == 0

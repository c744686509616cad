"""StepCapture on a GPU: each bucket's decode step recorded once as a CUDA graph.

Imported only when the device is a GPU. All buckets share one memory pool (captured largest
first, so the smaller graphs fit in its blocks). Each step is run twice before its capture
(lazy initialisation, allocator warm-up, flashinfer's first plan); the graph then replays
the step's ~1,200 kernels with one launch, reading the static inputs of DecodeInputs and the
bucket's flashinfer buffers, which are refilled before every replay.
"""

from __future__ import annotations

import torch

from common.model.decode_graphs import Step

WARMUP_RUNS = 2


class CudaGraphCapture:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, size: int, step: Step) -> Step:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.graphs[size] = graph

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

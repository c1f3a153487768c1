"""What each MoE layer's router chose, token by token, for whoever asks.

`MoETransformer.forward` / `forward_dense` take an optional `RoutingRecorder`
(None by default: the serving path records nothing and pays nothing). Given one,
every MoE layer hands it the expert ids its router chose for the tokens it routed,
as `moe.SigmoidRouter` chose them (top-k on the scores plus the correction bias,
within the top groups): the router stays a pure function, the recorder only sees
its output. The evaluator compares a candidate's choices with its parent's on the
same tokens (`gpuagent.evaluate.routing`).
"""

from __future__ import annotations

import torch
from torch import Tensor


class RoutingRecorder:
    """Expert ids per MoE layer, in the order the layers routed them.

    Each `record` appends one forward's ids [T, k] of one layer; `expert_ids`
    returns a layer's ids of every forward recorded, concatenated [N, k]. Kept on
    the CPU as int32 (a copy: the forward's own tensors are not held)."""

    def __init__(self) -> None:
        self._ids: dict[int, list[Tensor]] = {}

    def record(self, layer: int, ids: Tensor) -> None:
        """Layer `layer`'s choice for the tokens of one forward: ids [T, k]."""
        self._ids.setdefault(layer, []).append(ids.detach().to("cpu").int())

    @property
    def layers(self) -> list[int]:
        """The MoE layers that routed tokens, in layer order."""
        return sorted(self._ids)

    def expert_ids(self, layer: int) -> Tensor:
        """Every token layer `layer` routed, in order: int32 [N, k]."""
        return torch.cat(self._ids[layer])

    def clear(self) -> None:
        """Forget everything recorded."""
        self._ids.clear()

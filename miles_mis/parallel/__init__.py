"""Context and data parallelism: the collectives (`distributed`, the one module with torch.distributed code), the
call with its CP/DP peers (`peers.PeerReductions`, the correction's reductions over the groups), Megatron's zigzag
CP layout (`cp_layout`) and the wire format of the token rejections the ranks exchange (`rejection_wire`)."""

from .distributed import SINGLE, Group, PeerFailure, resolve_cp_group, resolve_dp_group, resolve_tp_group
from .peers import PeerReductions

__all__ = ["SINGLE", "Group", "PeerFailure", "PeerReductions", "resolve_cp_group", "resolve_dp_group",
           "resolve_tp_group"]

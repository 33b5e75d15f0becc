"""Host adapters: miles' and slime's own policy loss, run with miles_mis's correction through the hosts'
``--loss-type custom_loss`` seam, so that the correction sees what the whole batch holds without a host patch
(docs/hosts.md). Host code is imported lazily, when the loss is first called.

    --loss-type custom_loss --custom-loss-function-path miles_mis.hosts.miles_loss.policy_loss
    --loss-type custom_loss --custom-loss-function-path miles_mis.hosts.slime_loss.policy_loss
"""

from .adapter import ENTRY_POINT, Host, batch_inputs_for, entry_point, host_loss_module, policy_loss
from .miles_loss import MILES
from .slime_loss import SLIME

__all__ = ["ENTRY_POINT", "Host", "MILES", "SLIME", "batch_inputs_for", "entry_point", "host_loss_module",
           "policy_loss"]

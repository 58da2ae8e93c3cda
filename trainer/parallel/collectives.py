"""The all-gathers under torch 2.13's names on every supported torch (2.11 and later).

torch 2.13 renamed them (`all_gather_into_tensor` to `all_gather_single`; the functional
`all_gather_tensor` and `all_gather_tensor_autograd` to `all_gather_single` and
`all_gather_single_autograd`). Its old names print a FutureWarning into every run's output, and
torch 2.11 has only the old ones."""

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# into a preallocated output, every rank's tensor side by side (dist.all_gather_single)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# a new tensor, along gather_dim (funcol.all_gather_single), and the one autograd flows through
functional_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
functional_all_gather_autograd = (getattr(funcol, "all_gather_single_autograd", None)
                                  or funcol.all_gather_tensor_autograd)

"""optim=muon where the optimizer state is sharded (parallel=zero and parallel=fsdp): whole
matrices for Newton-Schulz, each on one owner rank.

Muon's step orthogonalizes the momentum of a whole matrix, so the row slices that ZeRO and FSDP
hand each rank are not enough. Every hidden matrix gets one owner rank (largest first, each to the
rank with the fewest elements so far: balanced by size, the same on every rank), which keeps the
matrix's momentum whole and runs Muon's step on it: trainer/optim/muon.py's BatchedMuon over the matrices
it owns, stacked by shape, each weight's parts (q, k, v; gate, up) orthogonalized on their own.
The owner stays per weight, balanced by size: owned by whole stack, gpt2_124m's two Newton-Schulz
stacks (768 x 768 and 768 x 3072) would load one rank twice the other.

- zero (replicas; DDP has all-reduced the gradients): the owner steps the model's own parameter,
  then every rank's updated matrices reach every rank in one all-gather (padded to the busiest
  rank's share). Per rank and step: receive the (W-1)/W of the hidden matrices it does not own,
  as zero's elementwise rows cost.
- fsdp (DTensor row shards of parameters and gradients): each rank sends its rows of a matrix's
  gradient to the owner (one all_to_all for all matrices), the owner assembles the whole gradient
  and runs Muon on a zeroed copy of the matrix with no decay, which leaves exactly the update
  (-adjusted lr x the orthogonalized momentum); each rank gets back its rows of the update (a
  second all_to_all) and applies the decoupled weight decay and the update to its shard. Per rank
  and step: about 2 x (W-1)/W^2 of the hidden matrices out and in, against FSDP's own (W-1)/W per
  all-gather, and no full parameter is ever gathered.
- tp (parallel.tp > 1, under none, fsdp or hsdp: DTensor blocks over the tp and FSDP dimensions): the
  same two all_to_alls with each rank's block of a matrix (the slice its placements give) in place of
  its rows; the owner assembles the gradient in the tp ranks' grouped rows and orders them
  [q | k | v] for Muon's parts, and regroups the update before cutting it into blocks. The owners are
  the ranks that split the matrices in one replica (HSDP x TP: one replica's dp_shard x tp ranks).

The orthogonalization is the one-process code in both; only which rank computes it changes, so the
numbers are those of one process (tests/parallel/test_muon.py, within 1e-5). Checkpoints hold each matrix's
momentum whole under its parameter name, written by its owner, which is also how BatchedMuon of
none / ddp (and the stock torch.optim.Muon before it) holds it: DCP moves it to any world size and
mode. A step under `found_inf` (train.on_nonfinite's device-side verdict) is masked: no update,
no decay, the momenta unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from trainer.optim.build import MatrixRun
from trainer.parallel.base import load_indexed_state, row_range
from trainer.parallel.collectives import all_gather_single
from trainer.parallel.tensor_parallel import group_rows, ungroup_rows


def assign_owners(numels: list[int], world: int) -> list[int]:
    """Owner rank of each matrix: largest first to the least-loaded rank (the first on a tie)."""
    owners, load = [0] * len(numels), [0] * world
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):  # stable: names order on ties
        rank = load.index(min(load))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def busiest_owner_numel(shapes: list, world: int) -> int:
    """Elements of the matrices the busiest owner rank holds whole (the memory plan's)."""
    numels = [math.prod(shape) for shape in shapes]
    owners = assign_owners(numels, world)
    return max(sum(n for n, o in zip(numels, owners) if o == rank) for rank in range(world))


class OwnedMuon:
    """Muon over matrices spread by owner. `run` names the optimizer (BatchedMuon), its options
    and the (name, parameter) hidden matrices in model order; `sharded` says whether each rank
    holds only rows of them (FSDP's DTensors) or whole replicas (zero). `param_groups` is one group
    on every rank, so the loop's learning rate reaches ranks that own nothing too. A step skips
    under `found_inf` (the attribute trainer.optim.build.verdict sets): the owners' Muon and the
    shards' decay are masked."""

    masks_on_device = True
    saves_by_name = True  # its state goes to checkpoints by parameter name (trainer/parallel/owned_state.py)

    def __init__(self, run: MatrixRun, *, rank: int, world: int, sharded: bool, group=None):
        # `group`: the ranks that split the matrices (None: all; HSDP: one replica's shard group),
        # `rank` and `world` counted within it
        self.rank, self.world, self.sharded, self.process_group = rank, world, sharded, group
        self.names = [name for name, _ in run.named]
        self.params = [param for _, param in run.named]
        self.shapes = [tuple(param.shape) for param in self.params]
        self.owners = assign_owners([param.numel() for param in self.params], world)
        self.mine = [i for i, owner in enumerate(self.owners) if owner == rank]
        self.weight_decay = run.kwargs.get("weight_decay", 0.0)
        self.row_parts = [tuple(run.row_parts.get(param, ())) for param in self.params]
        # Matrices split over a tp mesh dimension (and FSDP's rows with it): each rank's block of them
        self.tp = max(_tp_degree(param) for param in self.params) if self.params else 1
        if sharded and self.tp > 1:
            self._tensor_parallel_layout()
        overrides = {}
        if sharded:
            # Zeroed whole copies stepped with no decay leave the update itself (see the module doc).
            self.work = [nn.Parameter(torch.zeros(self.shapes[i], dtype=self._local(i).dtype,
                                                  device=self._local(i).device)) for i in self.mine]
            overrides["weight_decay"] = 0.0
        else:
            self.work = [self.params[i] for i in self.mine]
        work_parts = {work: run.row_parts[self.params[i]] for work, i in zip(self.work, self.mine)}
        self.inner = run.build(self.work, work_parts, **overrides) if self.work else None
        # the lr's holder on a rank that owns no matrix
        self._idle_group = {**run.group, **run.kwargs, **overrides, "params": []}

    @property
    def param_groups(self) -> list[dict]:
        # The inner optimizer's own (live: load_state_dict replaces its group objects).
        return self.inner.param_groups if self.inner else [self._idle_group]

    @property
    def group(self) -> dict:
        return self.param_groups[0]

    @property
    def state(self):
        return self.inner.state if self.inner else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None
        for work in self.work if self.sharded else []:
            work.grad = None

    def _local(self, i: int) -> torch.Tensor:
        param = self.params[i]
        return param.to_local() if isinstance(param, DTensor) else param

    def _rows(self, i: int, rank: int) -> slice:
        return slice(*row_range(self.shapes[i][0], rank, self.world))

    @torch.no_grad()
    def step(self) -> None:
        found_inf = getattr(self, "found_inf", None)
        if self.sharded and self.tp > 1:
            self._step_gathered(found_inf)
        elif self.sharded:
            self._step_sharded(found_inf)
        else:
            if self.inner:
                self.inner.step(found_inf=found_inf)
            self._all_gather_owned()

    # --- zero: whole replicas ------------------------------------------------------------------
    def _all_gather_owned(self) -> None:
        if self.world == 1:
            return
        for i, whole in self._owned_everywhere({i: self.params[i].detach() for i in self.mine}).items():
            if self.owners[i] != self.rank:
                self.params[i].detach().copy_(whole)

    def _owned_everywhere(self, mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{matrix: whole tensor} on every rank from each owner's `mine` (its matrices), in one
        all-gather padded to the busiest owner's share."""
        owned = [[i for i, o in enumerate(self.owners) if o == r] for r in range(self.world)]
        width = max(sum(math.prod(self.shapes[i]) for i in idx) for idx in owned)
        like = self._local(0)
        send = torch.zeros(width, dtype=like.dtype, device=like.device)
        offset = 0
        for i in owned[self.rank]:
            n = math.prod(self.shapes[i])
            send[offset: offset + n] = mine[i].reshape(-1)
            offset += n
        gathered = send.new_empty(self.world * width)  # gloo takes the concatenated form only
        all_gather_single(gathered, send, group=self.process_group)
        gathered = gathered.view(self.world, width)
        out = {}
        for r, idx in enumerate(owned):
            offset = 0
            for i in idx:
                n = math.prod(self.shapes[i])
                out[i] = gathered[r, offset: offset + n].view(self.shapes[i])
                offset += n
        return out

    # --- tp (with or without fsdp): DTensors split over several mesh dimensions --------------------
    def _tensor_parallel_layout(self) -> None:
        """The ranks that split the matrices (the parameters' mesh, less the dimensions every matrix
        is replicated over: HSDP's dp_replicate) and each one's piece of every matrix, as (rows, cols)
        slices of the DTensor's global (grouped) rows. Where those ranks are not this OwnedMuon's
        group (HSDP x TP: the group is one replica's dp_shard ranks, each tp rank in its own), the
        owners spread over a group of them instead (built collectively, one per replica)."""
        meshes = {(tuple(p.device_mesh.mesh.flatten().tolist()), tuple(p.device_mesh.shape)) for p in self.params}
        if len(meshes) != 1:
            raise ValueError("optim=muon under tensor parallelism needs every hidden matrix on one device mesh")
        mesh = self.params[0].device_mesh
        replicated = [d for d in range(mesh.ndim)
                      if all(isinstance(p.placements[d], Replicate) for p in self.params)]
        # the mesh's ranks of each replica, in mesh order (row-major over the dimensions that split)
        order = [*replicated, *(d for d in range(mesh.ndim) if d not in replicated)]
        split = mesh.mesh.permute(order).reshape(-1, math.prod(mesh.shape[d] for d in order[len(replicated):]))
        replica = next(row for row in split.tolist() if dist.get_rank() in row)
        group_ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
        if sorted(replica) != sorted(group_ranks):
            self.process_group, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in split])
            self.rank, self.world = dist.get_rank(self.process_group), len(replica)
            self.owners = assign_owners([param.numel() for param in self.params], self.world)
            self.mine = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        coordinates = {}
        for global_rank in replica:
            at = (mesh.mesh == global_rank).nonzero()[0].tolist()
            coordinates[dist.get_group_rank(self.process_group or dist.group.WORLD, global_rank)] = at
        # self.pieces[i][s]: group rank s's (rows, cols) of matrix i, in the DTensor's grouped rows
        self.pieces = []
        for i, param in enumerate(self.params):
            blocks = []
            for s in range(self.world):
                # (torch's public compute_local_shape_and_global_offset answers for this rank only)
                shape, offset = _compute_local_shape_and_global_offset(self.shapes[i], mesh.shape, coordinates[s],
                                                                       param.placements)
                blocks.append((slice(offset[0], offset[0] + shape[0]), slice(offset[1], offset[1] + shape[1])))
            mine_shape = (blocks[self.rank][0].stop - blocks[self.rank][0].start,
                          blocks[self.rank][1].stop - blocks[self.rank][1].start)
            if param.to_local().shape != mine_shape or not _tiles(blocks, self.shapes[i]):
                raise ValueError(f"{self.names[i]}: its shards are not blocks of one grid over the matrix")
            self.pieces.append(blocks)

    def _canonical(self, i: int, whole: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel matrix's rows in the model's own order ([q | k | v]), as Muon's parts read them."""
        return ungroup_rows(whole, self.row_parts[i], self.tp) if len(self.row_parts[i]) > 1 else whole

    def _grouped(self, i: int, whole: torch.Tensor) -> torch.Tensor:
        return group_rows(whole, self.row_parts[i], self.tp) if len(self.row_parts[i]) > 1 else whole

    def _piece_numel(self, i: int, s: int) -> int:
        rows, cols = self.pieces[i][s]
        return (rows.stop - rows.start) * (cols.stop - cols.start)

    def _step_gathered(self, found_inf: torch.Tensor | None) -> None:
        """_step_sharded's exchange for blocks: each rank's block of every gradient (its DTensor
        shard, the slice its placements give) goes to the matrix's owner in one all_to_all; the owner
        assembles the whole gradient in the grouped rows, ungroups them to the canonical order and
        steps Muon on a zeroed copy (leaving the update); the update, regrouped, goes back block by
        block in a second all_to_all, and each rank applies the decoupled decay and adds its block."""
        W = self.world
        # 1. each rank's block of every gradient to the matrix's owner
        grads = {d: [] for d in range(W)}
        for i, owner in enumerate(self.owners):
            grad = self.params[i].grad
            if grad.placements != self.params[i].placements:
                grad = grad.redistribute(placements=self.params[i].placements)
            grads[owner].append(grad.to_local())
        incoming = [[(i, self._piece_numel(i, s)) for i in self.mine] for s in range(W)]
        received = iter(self._exchange(grads, incoming))
        whole = {i: torch.empty(self.shapes[i], dtype=self._local(i).dtype, device=self._local(i).device)
                 for i in self.mine}
        for s in range(W):
            for i in self.mine:
                rows, cols = self.pieces[i][s]
                whole[i][rows, cols] = next(received).view(rows.stop - rows.start, cols.stop - cols.start)
        del received
        # 2. the owner's Muon step on zeroed copies, the gradients in canonical rows: the copies become the updates
        for work, i in zip(self.work, self.mine):
            work.zero_()
            work.grad = self._canonical(i, whole.pop(i))
        if self.inner:
            self.inner.step(found_inf=found_inf)
        # 3. each rank's block of the regrouped updates back, then decay and update on the shards
        grouped = {i: self._grouped(i, work.detach()) for work, i in zip(self.work, self.mine)}
        updates = {d: [grouped[i][self.pieces[i][d]] for i in self.mine] for d in range(W)}
        incoming = [[(i, self._piece_numel(i, self.rank)) for i, o in enumerate(self.owners) if o == s]
                    for s in range(W)]
        received = self._exchange(updates, incoming)
        del grouped, updates
        order = [i for s in range(W) for i, o in enumerate(self.owners) if o == s]
        decay = self.group["lr"] * self.weight_decay
        decay = 1 - decay if found_inf is None else 1 - (1 - found_inf) * decay
        for i, update in zip(order, received):
            local = self._local(i)
            local.mul_(decay)
            local.add_(update.view_as(local))

    # --- fsdp: row shards ----------------------------------------------------------------------
    def _exchange(self, pieces: dict[int, list[torch.Tensor]],
                  incoming: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """Send pieces[d] (flat tensors, concatenated) to each rank d in one all_to_all; return the
        received flat tensors, for each source rank the (matrix, numel) list `incoming[s]` says."""
        like = self._local(0)
        send_sizes = [sum(t.numel() for t in pieces[d]) for d in range(self.world)]
        recv_sizes = [sum(n for _, n in incoming[s]) for s in range(self.world)]
        chunks = [t.reshape(-1) for d in range(self.world) for t in pieces[d]]
        send = torch.cat(chunks) if chunks else like.new_empty(0)
        recv = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                               group=self.process_group)
        out, offset = [], 0
        for s in range(self.world):
            for _, n in incoming[s]:
                out.append(recv[offset: offset + n])
                offset += n
        return out

    def _cols(self, i: int) -> int:
        return self.shapes[i][1]

    def _step_sharded(self, found_inf: torch.Tensor | None) -> None:
        W = self.world
        # 1. each rank's rows of every gradient to the matrix's owner
        grads = {d: [] for d in range(W)}
        for i, owner in enumerate(self.owners):
            grad = self.params[i].grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            grads[owner].append(local)
        incoming = [[(i, (self._rows(i, s).stop - self._rows(i, s).start) * self._cols(i)) for i in self.mine]
                    for s in range(W)]
        received = iter(self._exchange(grads, incoming))
        whole = {i: torch.empty(self.shapes[i], dtype=self._local(i).dtype, device=self._local(i).device)
                 for i in self.mine}
        for s in range(W):
            for i in self.mine:
                rows = self._rows(i, s)
                whole[i][rows] = next(received).view(rows.stop - rows.start, self._cols(i))
        # 2. the owner's stock Muon step on zeroed copies: the copies become the updates
        for work, i in zip(self.work, self.mine):
            work.zero_()
            work.grad = whole[i]
        if self.inner:
            self.inner.step(found_inf=found_inf)
        # 3. each rank's rows of the updates back, then decay and update on the shards
        updates = {d: [work[self._rows(i, d)] for work, i in zip(self.work, self.mine)] for d in range(W)}
        incoming = [[(i, (self._rows(i, self.rank).stop - self._rows(i, self.rank).start) * self._cols(i))
                     for i, o in enumerate(self.owners) if o == s] for s in range(W)]
        received = self._exchange(updates, incoming)
        order = [i for s in range(W) for i, o in enumerate(self.owners) if o == s]
        decay = self.group["lr"] * self.weight_decay
        decay = 1 - decay if found_inf is None else 1 - (1 - found_inf) * decay
        for i, update in zip(order, received):
            local = self._local(i)
            local.mul_(decay)
            local.add_(update.view_as(local))

    # --- checkpoint state: each owned matrix's momentum, whole (canonical rows), by name ------------------------
    def state_dict_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        state = self.state
        return {self.names[i]: dict(state[work]) for work, i in zip(self.work, self.mine) if state.get(work)}

    def state_template(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.names[i]: {"momentum_buffer": torch.zeros(self.shapes[i], dtype=work.dtype, device=work.device)}
                for work, i in zip(self.work, self.mine)}

    def load_state_by_name(self, state: dict) -> None:
        if not self.inner:
            return
        load_indexed_state(self.inner, {j: state[self.names[i]] for j, i in enumerate(self.mine)
                                         if self.names[i] in state})


def _tp_degree(param) -> int:
    """The size of the tp dimension of a DTensor parameter's mesh (1: none)."""
    if not isinstance(param, DTensor):
        return 1
    names = param.device_mesh.mesh_dim_names or ()
    return param.device_mesh.size(names.index("tp")) if "tp" in names else 1


def _tiles(blocks: list[tuple[slice, slice]], shape: tuple[int, int]) -> bool:
    """Whether the distinct (rows, cols) blocks are a grid covering the matrix once: the column ranges
    split its columns and, in each, the row ranges split its rows (a slice from a first offset and a
    local shape would not, for a shard whose rows are not contiguous)."""
    by_cols: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rows, cols in {((r.start, r.stop), (c.start, c.stop)) for r, c in blocks}:
        by_cols.setdefault(cols, []).append(rows)
    return _splits(list(by_cols), shape[1]) and all(_splits(rows, shape[0]) for rows in by_cols.values())


def _splits(ranges: list[tuple[int, int]], length: int) -> bool:
    """Whether the [start, stop) ranges, empty ones aside, cover [0, length) end to end."""
    end = 0
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if start != end:
            return False
        end = stop
    return end == length


"""The device mesh of a `Layout`: every process group a layout needs, as named dimensions of one
`DeviceMesh` (torchtitan's ``ParallelDims`` in spirit), never as hand-built lists of ranks.

The world of ``pp x dp`` processes is the mesh ``[pp, ep_replicate, node, gpu]``, outermost first:

* ``pp``: the pipeline ranks of one data-parallel replica (the pipeline group);
* ``ep_replicate`` (``dp / ep``): the EP groups of a stage, each holding every routed expert once; the
  ranks that differ only here hold the same expert shard (the expert-replica group);
* ``node`` x ``gpu`` (``ep / gpus_per_node`` x ``gpus_per_node``): the ranks of one EP group, in nodes; the
  two-hop dispatch's inter-node hop runs along ``node`` (the ranks sharing a local index, one NIC each)
  and its intra-node hop along ``gpu``.

Flattened: ``ep`` = (node, gpu), one EP group; ``dp`` = (ep_replicate, node, gpu), a stage's data-parallel
replicas (the group that replicates, ZeRO-1-shards or FSDP-shards the dense parameters). Process
``p * dp + d`` is pipeline rank ``p`` of replica ``d``: a stage's replicas are consecutive processes, so an
EP group fills whole nodes, as the two-hop dispatch assumes. Without EP the last two dimensions have size
one; in a single process there is no mesh and every group is trivial.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dsv3.layout import Layout
from dsv3.parallel.ep_groups import EPGroups, NodeLayout

DIMS = ("pp", "ep_replicate", "node", "gpu")
FLATTENED = {"ep": ("node", "gpu"), "dp": ("ep_replicate", "node", "gpu")}


@dataclass
class ParallelMesh:
    """A layout's mesh over this world (None in a single process) and this process's place in it."""

    layout: Layout
    mesh: DeviceMesh | None
    device_type: str = "cpu"
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)  # ``ep``, ``dp``: kept, not sliced from mesh

    @classmethod
    def build(cls, layout: Layout, device: torch.device | str = "cpu") -> ParallelMesh:
        """The mesh of ``layout`` (a collective over the world: every rank builds it, in the same order)."""
        device_type = torch.device(device).type
        if layout.world == 1:
            return cls(layout, None, device_type)
        mesh = init_device_mesh(device_type, mesh_shape(layout), mesh_dim_names=DIMS)
        flattened = {name: mesh[dims]._flatten(name) for name, dims in FLATTENED.items()}
        return cls(layout, mesh, device_type, flattened)

    def sub(self, name: str) -> DeviceMesh | None:
        """The one-dimensional sub-mesh ``name`` (one of DIMS, or ``ep`` / ``dp``) holding this process."""
        if self.mesh is None:
            return None
        return self.flattened[name] if name in self.flattened else self.mesh[name]

    def group(self, name: str) -> dist.ProcessGroup | None:
        sub = self.sub(name)
        return None if sub is None else sub.get_group()

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this process's group along ``name``, in the dimension's order."""
        sub = self.sub(name)
        return [0] if sub is None else [int(r) for r in sub.mesh.flatten().tolist()]

    def size(self, name: str) -> int:
        sub = self.sub(name)
        return 1 if sub is None else sub.size()

    def local_rank(self, name: str) -> int:
        """This process's index along ``name`` (its data-parallel rank for ``dp``, pipeline rank for ``pp``)."""
        sub = self.sub(name)
        return 0 if sub is None else sub.get_local_rank()

    def is_first(self, name: str) -> bool:
        """Whether this process is the first along ``name`` (the one that counts a replicated tensor once)."""
        return self.local_rank(name) == 0

    def ep_groups(self, copy: int = 0) -> EPGroups:
        """This process's EP group with its node and rail sub-groups, for the two-hop dispatcher. ``copy`` k
        > 0 gives groups of the same members over communicators of their own, from another mesh (DualPipeV
        runs one stage's forward beside the other stage's backward, each stage's all-to-all on its own
        communicators). Every rank must ask for the same copies in the same order (a collective)."""
        mesh = self if copy == 0 else ParallelMesh.build(self.layout, self.device_type)
        return EPGroups(NodeLayout(self.layout.ep, self.layout.node_size), mesh.local_rank("ep"),
                        mesh.group("ep"), mesh.group("gpu"), mesh.group("node"))


def mesh_shape(layout: Layout) -> tuple[int, ...]:
    """The sizes of DIMS for ``layout``."""
    return layout.pp, layout.ep_replicas, layout.ep // layout.node_size, layout.node_size


def group_ranks(layout: Layout, name: str) -> list[list[int]]:
    """Every group along ``name`` (one of DIMS, or ``ep`` / ``dp``) as lists of global ranks, in the order
    the mesh gives them: pure arithmetic, for tests, docs and planners (no processes)."""
    dims = FLATTENED.get(name, (name,))
    keep = [DIMS.index(d) for d in dims]
    rest = [i for i in range(len(DIMS)) if i not in keep]
    grid = torch.arange(layout.world).reshape(mesh_shape(layout)).permute(*rest, *keep)
    size = 1
    for i in keep:
        size *= grid.shape[len(rest) + keep.index(i)]
    return grid.reshape(-1, size).tolist()

"""Build the (data, fsdp, tensor) device mesh from config."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass
class MeshConfig:
    """Mesh axis sizes; at most one may be -1, meaning "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete axis sizes for ``num_devices`` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        for name, size in zip(AXES, sizes):
            if size == 0 or size < -1:
                raise ValueError(f"mesh.{name} must be a positive size or -1, got {size}")
        free = [i for i, s in enumerate(sizes) if s == -1]
        if len(free) > 1:
            raise ValueError(f"only one mesh axis may be -1, got {dict(zip(AXES, sizes))}")
        fixed = int(np.prod([s for s in sizes if s != -1]))
        if free:
            if num_devices % fixed:
                raise ValueError(
                    f"{num_devices} devices cannot be split into mesh {dict(zip(AXES, sizes))}"
                )
            sizes[free[0]] = num_devices // fixed
        if int(np.prod(sizes)) != num_devices:
            raise ValueError(
                f"mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, "
                f"{num_devices} are available"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
    """A mesh with Auto axes (so sharding constraints and GSPMD propagation both work)."""
    cfg = cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    shape = cfg.resolve(len(devices))
    return jax.make_mesh(
        shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices
    )

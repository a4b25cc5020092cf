"""The links between a box's cards: each interconnect as the catalog and the detection name it, how the plan says it,
and what it does to the speed of several cards (data parallel's speed-up, sharding's efficiency on top). Owns LINKS;
launcher/plan/gpus.yaml's `interconnect`, Hardware.interconnect and the sizer's multi-GPU speed read it."""

from __future__ import annotations

from dataclasses import dataclass

NVLINK, PCIE, NONE = "nvlink", "pcie", "none"

# Data parallel's speed-up by card count over PCIe (community reports for 2-4 x RTX 4090: ~1.5-1.6x for 2)
_PCIE_SCALING = {1: 1.0, 2: 1.6, 4: 2.8, 8: 4.8}


@dataclass(frozen=True)
class Link:
    name: str  # as gpus.yaml and Hardware.interconnect write it
    title: str  # how the plan names it
    scaling: dict[int, float]  # data parallel's speed-up over one card, by card count
    sharding: float  # sharding's efficiency on top of that: an all-gather per layer in forward and backward


LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(NVLINK, "NVLink", {1: 1.0, 2: 1.8, 4: 3.5, 8: 6.8}, 0.95),  # the article: 1.8x for 2 cards, 3.5x for 4
        Link(PCIE, "PCIe", _PCIE_SCALING, 0.8),
        Link(NONE, "one card", _PCIE_SCALING, 1.0),
    )
}


def title(interconnect: str) -> str:
    return LINKS.get(interconnect, LINKS[PCIE]).title


def scaling(count: int, interconnect: str) -> float:
    """Data parallel's speed-up of `count` cards over one; between the listed counts, linear in the efficiency."""
    table = LINKS.get(interconnect, LINKS[PCIE]).scaling
    if count in table:
        return table[count]
    lower = max(k for k in table if k <= count)
    return table[lower] / lower * count


def sharding_efficiency(interconnect: str) -> float:
    return LINKS.get(interconnect, LINKS[PCIE]).sharding

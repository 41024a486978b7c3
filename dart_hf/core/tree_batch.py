"""A batch of draft trees, one per row, padded to one node count so that ONE target forward verifies them all.

Why padding and not packing: the verify forward takes input ids [rows, N] with one 4D mask per row
(`dart_hf.core.ragged.RaggedCache.verify_mask`), which is exactly the batched call every decoder already supports.
A row whose tree is smaller gets trailing padding nodes: token `fill`, depth 0, no parent edge into the real tree,
and an ancestor set of only themselves (so their attention row is never empty). No real node sees a padding node,
they are never accepted (`real` is False for them), and their cache entries are dropped with the rest of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree, DraftTrees


@dataclass
class TreeBatch:
    """Row r's tree occupies nodes [0, sizes[r]) of every [rows, N] / [rows, N, N] field (see `DraftTree`)."""

    tokens: torch.Tensor  # [rows, N]
    parents: torch.Tensor  # [rows, N]
    depths: torch.Tensor  # [rows, N]
    ancestor_mask: torch.Tensor  # [rows, N, N]
    sizes: torch.Tensor  # [rows]
    trees: list[DraftTree]  # the unpadded trees (the sampling walk and the budget statistics read them)

    @property
    def width(self) -> int:
        """N: nodes per row after padding."""
        return self.tokens.shape[1]

    @property
    def real(self) -> torch.Tensor:
        """[rows, N]: True for a row's own nodes, False for its padding."""
        return torch.arange(self.width, device=self.tokens.device) < self.sizes.unsqueeze(1)

    @classmethod
    def from_trees(cls, trees: DraftTrees, fill: int = 0) -> "TreeBatch":
        """The batched search's trees (`tree.build_trees`), padding tokens set to `fill`; reads the sizes back once
        (the per-row trees of the acceptance walk and the budget statistics)."""
        sizes = trees.sizes.tolist()
        real = torch.arange(trees.tokens.shape[1], device=trees.tokens.device) < trees.sizes.unsqueeze(1)
        tokens = torch.where(real, trees.tokens, fill)
        return cls(tokens, trees.parents, trees.depths, trees.ancestor_mask, trees.sizes,
                   [trees.row(r, n) for r, n in enumerate(sizes)])

    def to(self, device: torch.device) -> "TreeBatch":
        if self.tokens.device == torch.device(device):
            return self
        return TreeBatch(*(t.to(device) for t in (self.tokens, self.parents, self.depths, self.ancestor_mask,
                                                   self.sizes)), [t.to(device) for t in self.trees])

    @classmethod
    def stack(cls, trees: list[DraftTree], fill: int = 0) -> "TreeBatch":
        """Pad every tree to the largest one's node count (on the first tree's device)."""
        device = trees[0].tokens.device
        trees = [t.to(device) for t in trees]
        n = max(t.size for t in trees)
        rows = len(trees)
        tokens = torch.full((rows, n), fill, dtype=torch.long, device=device)
        parents = torch.zeros((rows, n), dtype=torch.long, device=device)
        depths = torch.zeros((rows, n), dtype=torch.long, device=device)
        anc = torch.eye(n, dtype=torch.bool, device=device).repeat(rows, 1, 1)
        for r, t in enumerate(trees):  # one slice copy per row (not per node)
            s = t.size
            tokens[r, :s], parents[r, :s], depths[r, :s] = t.tokens, t.parents, t.depths
            anc[r, :s, :s] = t.ancestor_mask
        sizes = torch.tensor([t.size for t in trees], device=device)
        return cls(tokens, parents, depths, anc, sizes, trees)

"""Walking and editing a module tree by dotted paths, including modules registered at two places."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

__all__ = ["get_path", "repeated_blocks", "replace_modules", "set_path", "walk_children"]


def walk_children(model: nn.Module, prefix: str = "") -> Iterator[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, child name, full name, child) for every module below ``model``, parents first.

    Unlike ``named_modules``, a module registered at two places is yielded at both.
    """
    for child_name, child in list(model._modules.items()):
        if child is None:
            continue
        full = f"{prefix}{child_name}"
        yield model, child_name, full, child
        yield from walk_children(child, f"{full}.")


def get_path(root: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted ``path`` below ``root`` (``None`` when nothing is there)."""
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    return getattr(parent, attr, None)


def set_path(root: nn.Module, path: str, module: nn.Module | None) -> None:
    """Put ``module`` at dotted ``path`` below ``root``; ``None`` removes what is there."""
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if module is None:
        if hasattr(parent, attr):
            delattr(parent, attr)
    else:
        setattr(parent, attr, module)


def replace_modules(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> None:
    """Replace every module below ``model`` for which ``replacement`` gives a module; one registered at
    two places is replaced once and stays shared."""
    done: dict[int, nn.Module] = {}
    for parent, child_name, _, child in list(walk_children(model)):
        if id(child) not in done:
            new = replacement(child)
            if new is None:
                continue
            done[id(child)] = new
        setattr(parent, child_name, done[id(child)])


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules of a class HF names in ``_no_split_modules`` (its decoder
    layers), else the members of the longest ``nn.ModuleList`` whose members share one class."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [
        list(m)
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1
    ]
    return max(lists, key=len, default=[])

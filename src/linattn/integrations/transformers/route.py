"""The route into transformers: every supported family, the replacement classes, and the switches
(:func:`enable`, :func:`disable`, :func:`enabled`, :func:`attach`, :func:`detach`). How it plugs in
is in the package's docstring."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading

from torch import nn

from . import delta as _delta
from . import mamba2 as _mamba2
from .layers import FORMS, Family, Form

#: Every supported family, by ``model_type``: the delta rule's, then Mamba-2's.
FAMILIES: dict[str, Family] = {**_delta.FAMILIES, **_mamba2.FAMILIES}


# ---------------------------------------------------------------------------------------------
# The replacement classes and the switch
# ---------------------------------------------------------------------------------------------

_lock = threading.RLock()
_classes: dict[tuple[str, str], type] = {}  # (model_type, form) -> replacement class
_registered: dict[str, type] = {}  # layer class name -> the replacement this module registered


def require_transformers(what: str):
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(f"linattn.integrations.transformers.{what} needs transformers, which is not "
                                  "installed; install the optional extra: pip install 'linattn[transformers]'",
                                  name="transformers")
    import transformers

    return transformers


def check_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"linattn.integrations.transformers: unsupported model type {name!r}; supported: "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[name]


def _check_model_types(model_types) -> tuple[str, ...]:
    if isinstance(model_types, (str, bytes)) or not isinstance(model_types, (tuple, list, set, frozenset)):
        example = f"({model_types!r},)" if isinstance(model_types, str) else '("qwen3_5",)'
        raise TypeError(f"linattn.integrations.transformers: model_types must be a tuple of model type names, e.g. "
                        f"{example}, or None for every family; got the {type(model_types).__name__} {model_types!r}")
    bad = [name for name in model_types if not isinstance(name, str)]
    if bad:
        raise TypeError(f"linattn.integrations.transformers: model_types must hold model type names (str), got "
                        f"{bad[0]!r} in {model_types!r}")
    return tuple(model_types)


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"linattn.integrations.transformers: form must be one of {FORMS}, got {form!r}")


def _original(family: Family, name: str | None = None) -> type:
    """transformers' class ``name`` (the family's layer class by default) in the family's module."""
    name = family.layer if name is None else name
    module = importlib.import_module(family.module)
    cls = getattr(module, name, None)
    if cls is None:
        raise ImportError(f"linattn.integrations.transformers: {family.module} has no class {name} (the "
                          "installed transformers moved it); this family cannot be patched")
    # inside transformers' apply_patches the module holds the replacement
    while getattr(cls, "_linattn_family", None) is not None or getattr(cls, "_linattn_holds", None) is not None:
        cls = cls.__mro__[1]
    return cls


def _init(self, *args, **kwargs):
    type(self).__mro__[1].__init__(self, *args, **kwargs)  # the original layer's __init__, as it is
    check_layer(self)


def check_layer(layer: nn.Module) -> None:
    missing = [name for name in layer._linattn_family.needs if not hasattr(layer, name)]
    if missing:
        raise TypeError(f"linattn.integrations.transformers: {type(layer).__mro__[1].__name__} has no "
                        f"{', '.join(missing)}: the installed transformers changed this layer, which linattn "
                        "cannot run; disable the integration (linattn.integrations.transformers.disable())")


def replacement_class(model_type: str, form: Form = "chunked") -> type:
    """The layer class that replaces ``model_type``'s linear-attention layer: a subclass of it that
    only overrides ``forward`` (no parameters or buffers of its own). ``form``: ``"chunked"`` (the
    fast engine) or ``"reference"`` (linattn's float64 reference recurrence, a loop over positions:
    for checking, never for speed)."""
    family = check_family(model_type)
    _check_form(form)
    require_transformers("replacement_class")
    with _lock:
        key = (model_type, form)
        if key not in _classes:
            original = _original(family)
            prefix = "Linattn" if form == "chunked" else "LinattnReference"
            _classes[key] = type(f"{prefix}{original.__name__}", (original,), {
                "__init__": _init, "forward": family.forward, "_linattn_family": family, "_linattn_form": form,
                "__module__": __name__,
                "__doc__": f"{original.__name__} running on linattn ({form}); weights and names unchanged."})
        return _classes[key]


def _holder_init(self, *args, **kwargs):
    type(self).__mro__[1].__init__(self, *args, **kwargs)  # the original holder's __init__, as it is
    family, form = self._linattn_holds
    layer = getattr(self, family.holder[1], None)
    replacement = replacement_class(family.model_type, form)
    if type(layer) is replacement.__mro__[1]:  # this block holds the family's layer (not attention, an MLP, ...)
        layer.__class__ = replacement
        check_layer(layer)


def _holder_class(family: Family, form: Form) -> type:
    """For a family whose model builds its layer through a table of classes made at import
    (:attr:`Family.holder`): a subclass of the holder class (the block) that builds itself as
    transformers does, then switches its layer to :func:`replacement_class`. No state of its own."""
    with _lock:
        key = (family.model_type, form, "holder")
        if key not in _classes:
            original = _original(family, family.holder[0])
            _classes[key] = type(f"Linattn{original.__name__}", (original,), {
                "__init__": _holder_init, "_linattn_holds": (family, form), "__module__": __name__,
                "__doc__": f"{original.__name__} whose {family.layer} runs on linattn ({form})."})
        return _classes[key]


def enable(*, form: Form = "chunked", model_types: tuple[str, ...] | None = None) -> None:
    """Make every supported model built afterwards by ``from_pretrained`` / ``from_config`` run its
    linear-attention layers on linattn (through ``transformers.monkey_patching.register_patch_mapping``).

    Args:
        form: ``"chunked"`` or ``"reference"`` (see :func:`replacement_class`).
        model_types: the families to patch (None: all of :data:`FAMILIES`).

    Raises TypeError when ``model_types`` is not a collection of names (a bare string included:
    it would be read one character at a time), ValueError for an unknown family or form, or when
    another library registered a patch for one of these layer classes (this one never overwrites it)."""
    _check_form(form)
    names = tuple(FAMILIES) if model_types is None else _check_model_types(model_types)
    families = [check_family(name) for name in names]
    require_transformers("enable")
    from transformers.monkey_patching import get_patch_mapping, register_patch_mapping

    with _lock:
        current = get_patch_mapping()
        mapping = {}
        for family in families:
            for name in (family.layer,) + (() if family.holder is None else family.holder[:1]):
                theirs = current.get(name)
                if theirs is not None and _registered.get(name) is not theirs:
                    raise ValueError(f"linattn.integrations.transformers.enable: {name} already has a patch "
                                     f"registered by someone else ({theirs.__module__}.{theirs.__qualname__}); not "
                                     "overwriting it")
            mapping[family.layer] = replacement_class(family.model_type, form)
            if family.holder is not None:
                mapping[family.holder[0]] = _holder_class(family, form)
        register_patch_mapping(mapping, overwrite=True)
        _registered.update(mapping)


def disable() -> None:
    """Undo :func:`enable`: models built afterwards use transformers' own layers again (models built
    before keep the classes they were built with; :func:`detach` switches those)."""
    if not _registered:
        return
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    with _lock:
        current = get_patch_mapping()
        ours = [name for name, cls in _registered.items() if current.get(name) is cls]
        if ours:
            unregister_patch_mapping(ours)
        _registered.clear()


def is_enabled(model_type: str | None = None) -> bool:
    """Whether :func:`enable` is in effect (for ``model_type``, or for any family)."""
    if not _registered:
        return False
    from transformers.monkey_patching import get_patch_mapping

    current = get_patch_mapping()
    names = [check_family(model_type).layer] if model_type is not None else list(_registered)
    return any(name in _registered and current.get(name) is _registered[name] for name in names)


@contextlib.contextmanager
def enabled(*, form: Form = "chunked", model_types: tuple[str, ...] | None = None):
    """:func:`enable` inside a ``with`` block; on leaving, the registrations are as they were."""
    with _lock:
        before = dict(_registered)
        enable(form=form, model_types=model_types)
    try:
        yield
    finally:
        with _lock:
            disable()
            if before:
                from transformers.monkey_patching import register_patch_mapping

                register_patch_mapping(before, overwrite=True)
                _registered.update(before)


def _layers(model: nn.Module):
    for module in model.modules():
        cls = type(module)
        for family in FAMILIES.values():
            if cls.__name__ == family.layer or getattr(cls, "_linattn_family", None) is family:
                yield module, family
                break


def attach(model: nn.Module, *, form: Form = "chunked") -> int:
    """Switch the linear-attention layers of an already built ``model`` to linattn (their class
    becomes :func:`replacement_class`; weights untouched). Returns how many layers were switched.
    Raises ValueError, naming the model, when it has none of a supported family."""
    _check_form(form)
    count = 0
    for module, family in _layers(model):
        cls = replacement_class(family.model_type, form)
        if not isinstance(module, cls.__mro__[1]):
            continue
        module.__class__ = cls
        check_layer(module)
        count += 1
    if count == 0:
        raise ValueError(f"linattn.integrations.transformers.attach: {type(model).__name__} has no linear-attention "
                         f"layer linattn supports (layer classes: {', '.join(f.layer for f in FAMILIES.values())})")
    return count


def detach(model: nn.Module) -> int:
    """Switch ``model``'s linattn layers back to transformers' own classes. Returns how many."""
    count = 0
    for module, _ in _layers(model):
        if getattr(type(module), "_linattn_family", None) is not None:
            module.__class__ = type(module).__mro__[1]
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Small models of every family: for tests, the README, the demo and the benchmarks
# ---------------------------------------------------------------------------------------------


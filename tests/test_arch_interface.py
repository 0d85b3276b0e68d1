"""Every registered architecture module honours `interface.ArchModule`, and its CAPABILITIES say
exactly which optional protocols it implements (the engine reads the flags, never probes)."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from flax import struct

from pantheon.jax_models import common, interface, registry

MODULES = registry.registered_modules()


def _params(fn) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _check_functions(mod, proto: type) -> None:
    for name in interface.protocol_functions(proto):
        assert callable(getattr(mod, name, None)), f"{mod.__name__} lacks {proto.__name__}.{name}"
        want = _params(getattr(proto, name))
        assert _params(getattr(mod, name)) == want, f"{mod.__name__}.{name}: parameters differ from {want}"


def test_every_arch_in_the_table_has_a_module():
    assert {m.__name__.rsplit(".", 1)[1] for m in MODULES} == {"llama", "phi3", "gemma3", "qwen35", "rwkv7"}


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_module_satisfies_the_protocol(mod):
    _check_functions(mod, interface.ArchModule)
    assert isinstance(mod.ARCHS, tuple) and all(registry.module_for(a) is mod for a in mod.ARCHS)
    assert isinstance(mod.CAPABILITIES, interface.Capabilities)


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_capabilities_agree_with_the_optional_functions(mod):
    caps = registry.capabilities_of(mod)
    assert set(interface.CAPABILITY_PROTOCOLS) == set(interface.capability_names())
    for flag, proto in interface.CAPABILITY_PROTOCOLS.items():
        if getattr(caps, flag):
            _check_functions(mod, proto)
        else:
            present = [n for n in interface.protocol_functions(proto) if hasattr(mod, n)]
            assert not present, f"{mod.__name__} has {present} but does not declare {flag}"


def test_expected_capabilities():
    caps = {m.__name__.rsplit(".", 1)[1]: registry.capabilities_of(m) for m in MODULES}
    assert caps["phi3"] == interface.Capabilities(mixed_steps=True, fused_projections=True)
    # llama is also the text tower of Idefics3 / SmolVLM (issue 34)
    assert caps["llama"] == interface.Capabilities(mixed_steps=True, fused_projections=True, image_inputs=True)
    assert caps["gemma3"] == interface.Capabilities(image_inputs=True)  # the Gemma 3 VLM (issue 34)
    assert caps["rwkv7"] == interface.Capabilities(recurrent_state=True)
    assert caps["qwen35"] == interface.Capabilities(recurrent_state=True)
    assert registry.capabilities_of(None) == registry.capabilities_of(object()) == interface.Capabilities()


def test_capabilities_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        interface.Capabilities().mixed_steps = True  # type: ignore[misc]


def test_kv_cache_is_a_dataclass_pytree_named_by_field():
    cache = common.init_kv(2, 3, 1, 4, 8, jnp.bfloat16)
    assert isinstance(cache, common.KVCache) and cache.k.shape == (2, 3, 1, 4, 8) and cache.v.dtype == jnp.bfloat16
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(cache)]
    assert paths == [".k", ".v"]


def test_present_lists_set_fields_only():
    @struct.dataclass
    class Demo:
        a: int
        b: object = None

    assert common.present(Demo(a=1)) == {"a": 1}
    assert common.present(None) == {}


def test_hybrid_state_and_snapshot_are_typed():
    from pantheon.jax_models import qwen35

    cfg = SimpleNamespace(n_layers=4, n_kv_heads=1, head_dim=8, arch="qwen35",
                          extra={"ssm.conv_kernel": 4, "ssm.state_size": 4, "ssm.group_count": 1,
                                 "ssm.time_step_rank": 2, "ssm.inner_size": 8, "full_attention_interval": 2})
    state = qwen35.init_state(cfg, 3, 16)
    assert isinstance(state, qwen35.HybridCache) and state.k.shape == (2, 3, 1, 16, 8)
    assert state.recurrent.ssm.shape == (2, 3, 2, 4, 4) and state.recurrent.conv.shape == (2, 3, 3, 16)
    snap = qwen35.snapshot_slot(state, 1)
    assert isinstance(snap, qwen35.RecurrentState) and snap.ssm.shape == (2, 2, 4, 4)
    restored = qwen35.restore_slot(state, 2, jax.tree.map(jnp.ones_like, snap))
    assert float(restored.recurrent.ssm[:, 2].min()) == 1.0 and not restored.recurrent.ssm[:, :2].any()

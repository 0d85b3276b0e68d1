"""The contract between the engine and an architecture module, written down in one place.

Why a Protocol and a `Capabilities` record instead of probing modules with `hasattr`: the engine,
the batch scheduler and the die planner each need to know what a module can do (mixed steps,
recurrent state, fused projections). A probe is an implicit, per-caller spelling of that contract:
a renamed function silently turns a feature off, and nothing says which functions belong together.
Here every module states its capabilities as data (`CAPABILITIES`), the signatures it must provide
are the Protocols below, and `tests/test_arch_interface.py` checks each registered module against
both, so a declaration and the functions behind it cannot drift apart.

Shapes use the letters of `common`: B batch rows, T tokens per row in this step, S cache slots
(the engine's slots plus one scratch slot), C cache capacity, V vocabulary.

Params and state are `flax.struct` dataclasses (per-architecture classes such as
`llama.LlamaParams`, `common.KVCache`, `qwen35.HybridCache`): pytrees whose field names are the
path components that `pantheon.runtime.sharding` reads, and whose unused optional fields are None (an
empty subtree, so they cost nothing and appear in no jit signature).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

import jax

from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.ops.weights import Kernels

# A step row group: tokens [B, T], slots [B], start [B], n_new [B] (all int32).
Group = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


@dataclass(frozen=True)
class Capabilities:
    """What an architecture module offers beyond the required `ArchModule` functions.

    Each flag names one optional protocol below; a module declares exactly the ones it implements.
    """

    mixed_steps: bool = False
    """`forward_groups` exists (`MixedSteps`): a prefill chunk and the decode rows of the other
    slots can run as one step, so a new prompt does not stall the decoders."""

    fused_projections: bool = False
    """`fuse_projections` exists (`FusedProjections`): matrices that read the same input can be
    concatenated into one product after loading (single die only: the tensor-parallel rules split
    q/k/v by their own heads)."""

    image_inputs: bool = False
    """`forward_images` exists (`ImageInputs`): the forward takes input embeddings that replace the token
    embeddings at some positions (a vision projector's image rows: the design's `embd_override`)."""

    recurrent_state: bool = False
    """The state holds per-slot recurrent parts that cannot be rolled back to an earlier position
    (`RecurrentSlots`: snapshot/restore/reset of one slot). Prefix reuse must then be all or
    nothing: a slot is only valid at its committed boundary, never at a shorter prefix."""


class ArchModule(Protocol):
    """What every architecture module (`pantheon.jax_models.<arch>`) provides.

    Every function is pure (params and state in, new values out) so the engine can jit it with the
    state donated; `cfg` and `span` are static.
    """

    ARCHS: tuple[str, ...]
    """The GGUF `general.architecture` strings this module implements."""

    CAPABILITIES: Capabilities
    """Which optional protocols (`MixedSteps`, `FusedProjections`, `RecurrentSlots`) it implements."""

    @staticmethod
    def load_params(src: TensorSource, cfg: ModelConfig) -> Any:
        """Host params (the module's params dataclass) read from `src`: matrices as QuantWeights in
        the file's format (views of the mapped file, never widened), vectors as f32 numpy stacks."""

    @staticmethod
    def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype: Any = ...) -> Any:
        """A zeroed cache dataclass for `n_slots` slots of `capacity` positions each; `dtype` is the
        KV dtype (recurrent parts, where any, stay f32)."""

    @staticmethod
    def state_bytes_per_token(cfg: ModelConfig) -> int:
        """f32 bytes of state one cached position costs (the part that grows with length)."""

    @staticmethod
    def state_bytes_per_sequence(cfg: ModelConfig) -> int:
        """f32 bytes of fixed state one sequence holds whatever its length (0 for KV-only models).
        The die planner adds it once per slot."""

    @staticmethod
    def forward(params: Any, state: Any, tokens: jax.Array, slots: jax.Array, start: jax.Array,
                n_new: jax.Array, *, cfg: ModelConfig, span: int, all_logits: bool = False,
                kernels: Kernels = ...) -> tuple[jax.Array, Any]:
        """One step over B rows of T tokens: row b feeds n_new[b] real tokens (then padding) into
        slot slots[b] at positions start[b]... `span` bounds the cache positions attention reads.
        Returns f32 logits [B, V] of each row's last real token ([B, T, V] with all_logits) and the
        new state (same structure and shapes as `state`)."""

    @staticmethod
    def hidden_states(params: Any, state: Any, tokens: jax.Array, slots: jax.Array, start: jax.Array,
                      n_new: jax.Array, *, cfg: ModelConfig, span: int,
                      kernels: Kernels = ...) -> tuple[jax.Array, Any]:
        """`forward` without the LM head: the final hidden states [B, T, H] of every position (after
        the final norm), which embeddings pool, and the new state (written exactly as `forward`
        writes it; a row starting at position 0 starts a new sequence). Why every module has it: an
        embedding is the same forward as a prompt chunk, so it must share the body, not copy it."""


class MixedSteps(ArchModule, Protocol):
    """`Capabilities.mixed_steps`."""

    @staticmethod
    def forward_groups(params: Any, state: Any, groups: tuple[Group, ...], *, cfg: ModelConfig, span: int,
                       all_logits: bool = False, kernels: Kernels = ...) -> tuple[jax.Array, Any]:
        """One step over several row groups, each with its own [B, T]: every matmul sees all the
        step's tokens at once. Returns logits [sum of B, V], groups in order (all_logits: one group)."""


class FusedProjections(ArchModule, Protocol):
    """`Capabilities.fused_projections`."""

    @staticmethod
    def fuse_projections(params: Any) -> Any:
        """The same params with same-input matrices concatenated where every layer's parts share a
        format; the forward accepts both forms."""


class ImageInputs(ArchModule, Protocol):
    """`Capabilities.image_inputs`."""

    @staticmethod
    def forward_images(params: Any, state: Any, tokens: jax.Array, slots: jax.Array, start: jax.Array,
                       n_new: jax.Array, override: Any, *, cfg: ModelConfig, span: int, all_logits: bool = False,
                       kernels: Kernels = ...) -> tuple[jax.Array, Any]:
        """`forward` with `override` (`common.EmbdOverride`): its rows replace the input embeddings where
        `override.use` is set, and positions of one image block attend to each other where the
        architecture says so (Gemma 3)."""


class RecurrentSlots(ArchModule, Protocol):
    """`Capabilities.recurrent_state`."""

    @staticmethod
    def snapshot_slot(state: Any, slot: jax.Array | int) -> Any:
        """Copies of one slot's recurrent parts (what a prefix cache stores with its KV rows)."""

    @staticmethod
    def restore_slot(state: Any, slot: jax.Array | int, snap: Any) -> Any:
        """`state` with one slot's recurrent parts replaced by `snap`; `state` is donated."""

    @staticmethod
    def reset_slot(state: Any, slot: jax.Array | int) -> Any:
        """`state` with one slot's recurrent parts zeroed; `state` is donated."""


# Capability flag -> the protocol whose functions it promises.
CAPABILITY_PROTOCOLS: dict[str, type] = {
    "mixed_steps": MixedSteps,
    "fused_projections": FusedProjections,
    "recurrent_state": RecurrentSlots,
    "image_inputs": ImageInputs,
}

def protocol_functions(proto: type) -> tuple[str, ...]:
    """The function names `proto` itself declares (not those it inherits)."""
    return tuple(k for k, v in vars(proto).items() if isinstance(v, staticmethod))


def capability_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Capabilities))

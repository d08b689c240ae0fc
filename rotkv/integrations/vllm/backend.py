"""rotkv's vLLM attention backend (vLLM 0.20 - 0.26; written against 0.26's ``vllm.v1.attention``).

- :class:`RotkvAttentionBackend`: the class ``AttentionBackendEnum.CUSTOM`` points at
  (:func:`rotkv.integrations.vllm.register`).
  Its KV cache per layer is one uint8 tensor of ``num_blocks`` INT2 pages (:mod:`rotkv.integrations.vllm.layout`).
- :class:`RotkvAttentionSpec`: vLLM's ``FullAttentionSpec`` with the INT2 page size (the bytes of one token and KV
  head, keys and values with their metadata, times ``block_size * num_kv_heads``), so that vLLM's block
  accounting gives the tokens the format saves; :func:`install_spec_hook` makes the attention layers that run
  this backend report it (vLLM's ``Attention.get_kv_cache_spec`` assumes 16-bit elements otherwise).
- :class:`RotkvMetadataBuilder`: once per step, the host plan every layer follows
  (:func:`rotkv.integrations.vllm.state.plan_step`) and the side-pool slots of the step's requests
  (:func:`row_keys`).
- :class:`RotkvAttentionImpl`: per layer, the rotation and codecs of its artifact/preset (this rank's KV heads),
  the bf16 side pool, the refine rings of a preset with a refine tier (per side-pool slot), and
  :func:`rotkv.integrations.vllm.attention.layer_step`.

Refused with a clear error: prefix caching, speculative decoding, sliding-window / ALiBi / soft-cap / encoder
attention, KV-sharing layers, quantized ``kv_cache_dtype``, block sizes other than 16, output quantization.
The metadata builder keys the side pool's slots by the request ids vLLM's model runner holds on the host
(:mod:`rotkv.integrations.vllm.runner`), with no read from the device. Batches of decode rows run on fixed
buffers inside vLLM's full CUDA graphs (:mod:`rotkv.integrations.vllm.graph`,
AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE); other batches, and every batch with ``cuda_graphs`` false, run
attention eagerly between vLLM's piecewise graphs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from rotkv.integrations.vllm.attention import layer_step, slot_rings
from rotkv.integrations.vllm.config import PAGE_SIZE, WHERE, layer_codecs, load_rotations, parse_settings
from rotkv.integrations.vllm.graph import StaticDecode, is_static_batch, static_plan, static_step
from rotkv.integrations.vllm.layout import BlockLayout, blocks_in, group_page_bytes
from rotkv.integrations.vllm.runner import RUNNERS, STEP, install_runner_hooks
from rotkv.integrations.vllm.state import Geometry, SlotTable, StepPlan, plan_step
from rotkv.integrations.vllm.tp import shard_rotation

# bytes per token and KV head of the running model's group, by (num_kv_heads, head_size): set when the specs
# are made (the same worker process then shapes the KV tensors, get_kv_cache_shape)
_SLOT_BYTES: dict[tuple[int, int], int] = {}
_SLOT_TABLES: dict[tuple, SlotTable] = {}


@dataclass(frozen=True, kw_only=True)
class RotkvAttentionSpec(FullAttentionSpec):
    """FullAttentionSpec whose page is ``block_size * num_kv_heads * rotkv_slot_bytes`` bytes (uint8)."""

    rotkv_slot_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.rotkv_slot_bytes

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        if any(s.rotkv_slot_bytes != specs[0].rotkv_slot_bytes for s in specs):
            raise ValueError("rotkv: every layer of a KV-cache group must report the same page size")
        return replace(merged, rotkv_slot_bytes=specs[0].rotkv_slot_bytes)


@dataclass(frozen=True)
class ModelPlan:
    """What the model's layers store, resolved once per process from the settings and vLLM's geometry."""

    settings: object
    rotations: tuple  # every layer's LayerRotation, all KV heads, on the CPU
    codecs: tuple  # every layer's (key, value) TokenCodec
    layouts: tuple  # every layer's BlockLayout (this rank's heads)
    slot_bytes: int  # the group's bytes per token and KV head (the largest layer's)
    geometry: Geometry
    total_kv_heads: int
    tp_size: int
    tp_rank: int


def _tier_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "model" else getattr(torch, name)


_PLANS: dict[str, ModelPlan] = {}


def _model_plan(vllm_config: VllmConfig) -> ModelPlan:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    settings = parse_settings(vllm_config.additional_config)
    mc = vllm_config.model_config
    layers = mc.hf_text_config.num_hidden_layers
    total_h, d = mc.get_total_num_kv_heads(), mc.get_head_size()
    try:
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except AssertionError:  # no process group (a test building the classes alone): a single rank
        tp, rank = 1, 0
    local_h = mc.get_num_kv_heads(vllm_config.parallel_config)
    # vLLM builds the model under a CUDA default device; the plan is built on the CPU (each layer moves its
    # own part to its device on its first forward)
    with torch.device("cpu"):
        rots, art = load_rotations(settings, layers, total_h, d, mc.max_model_len)
        codecs = tuple(layer_codecs(settings.spec, i, d, rots[i], art, layers) for i in range(layers))
    layouts = tuple(BlockLayout.of(local_h, d, PAGE_SIZE, *c) for c in codecs)
    slot = group_page_bytes(layouts) // (PAGE_SIZE * local_h)
    spec = settings.spec
    geo = Geometry(spec.sink, spec.window, spec.window_share, PAGE_SIZE, mc.max_model_len,
                   -(-spec.refine_tokens // PAGE_SIZE), spec.refine_every)
    return ModelPlan(settings, tuple(rots), codecs, layouts, slot, geo, total_h, tp, rank)


def model_plan(vllm_config: VllmConfig | None = None) -> ModelPlan:
    """The process's :class:`ModelPlan` (made once per model, settings and length; the artifact is read once)."""
    vllm_config = vllm_config or get_current_vllm_config()
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    mc = vllm_config.model_config
    key = json.dumps([extra.get("rotkv"), str(mc.model), mc.max_model_len], sort_keys=True, default=str)
    if key not in _PLANS:
        _PLANS[key] = _model_plan(vllm_config)
    return _PLANS[key]


def install_spec_hook() -> None:
    """Make ``Attention.get_kv_cache_spec`` return a :class:`RotkvAttentionSpec` for layers on this backend."""
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.get_kv_cache_spec, "_rotkv", False):
        return
    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is None or not isinstance(getattr(self, "impl", None), RotkvAttentionImpl):
            return spec
        if type(spec) is not FullAttentionSpec:
            raise ValueError(f"rotkv's vLLM backend serves full-attention layers only, not {type(spec).__name__} "
                             f"({self.layer_name})")
        plan = model_plan(vllm_config)
        _SLOT_BYTES[(spec.num_kv_heads, spec.head_size)] = plan.slot_bytes
        fields = {f: getattr(spec, f) for f in ("block_size", "num_kv_heads", "head_size", "head_size_v",
                                                 "sliding_window", "attention_chunk_size")}
        return RotkvAttentionSpec(**fields, dtype=torch.uint8, rotkv_slot_bytes=plan.slot_bytes)

    get_kv_cache_spec._rotkv = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def layer_index(layer_name: str) -> int:
    """The model layer of an attention module's name (``model.layers.7.self_attn.attn`` -> 7), as vLLM's
    ``extract_layer_index`` reads it: the one integer component."""
    ints = [int(x) for x in layer_name.split(".") if x.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"rotkv: cannot tell the layer index of attention module {layer_name!r}")
    return ints[0]


class RotkvAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [PAGE_SIZE]

    @staticmethod
    def get_impl_cls():
        return RotkvAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RotkvMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        slot = _SLOT_BYTES.get((num_kv_heads, head_size))
        if slot is None:
            raise RuntimeError("rotkv: the KV-cache spec hook has not run in this process; is the plugin loaded "
                               "(pip install rotkv, or rotkv.integrations.vllm.register())?")
        return (num_blocks, block_size * num_kv_heads * slot)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class RotkvMetadata(AttentionMetadata):
    plan: StepPlan | None  # the general step's plan; None for a batch on the fixed buffers
    block_table: torch.Tensor
    num_actual_tokens: int
    static: StaticDecode | None = None  # a decode batch on the fixed buffers (graphed): its rows in ``rows``
    rows: int = 0


class RotkvMetadataBuilder(AttentionMetadataBuilder[RotkvMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """Full graphs for decode batches, unless the settings say otherwise (``cuda_graphs``)."""
        graphed = parse_settings(vllm_config.additional_config).cuda_graphs
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if graphed else AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("rotkv's vLLM backend does not support prefix caching (a shared block could sit inside "
                             "another request's bf16 window): pass enable_prefix_caching=False "
                             "(vllm serve --no-enable-prefix-caching)")
        if vllm_config.speculative_config is not None:
            raise ValueError("rotkv's vLLM backend does not support speculative decoding")
        if kv_cache_spec.block_size != PAGE_SIZE:
            raise ValueError(f"rotkv's vLLM backend needs block_size={PAGE_SIZE} (one block is one INT2 page), got "
                             f"{kv_cache_spec.block_size}")
        self.mp = model_plan(vllm_config)
        install_runner_hooks()  # the runner's module is loaded by now: it builds this builder
        slots = vllm_config.scheduler_config.max_num_seqs + self.mp.settings.spare_slots
        self.slots = _SLOT_TABLES.setdefault((slots, self.mp.geometry), SlotTable(slots))
        # the graphed decode step's buffers, for the largest batch vLLM runs (captured or not)
        comp = vllm_config.compilation_config
        rows = max(vllm_config.scheduler_config.max_num_seqs, getattr(comp, "max_cudagraph_capture_size", 0) or 0)
        lay = self.mp.layouts[0]
        self.static = StaticDecode(self.mp.geometry, rows, self.slots.scratch, device, lay.kv_heads, lay.head_dim) \
            if self.mp.settings.cuda_graphs else None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RotkvMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        qs = cm.query_start_loc_cpu[: b + 1].numpy().astype(np.int64)
        # exact on the host without speculative decoding (refused); older vLLMs name it differently
        lens = getattr(cm, "seq_lens_cpu_upper_bound", None)
        lens = lens if lens is not None else getattr(cm, "_seq_lens_cpu", None)
        lens = (lens if lens is not None else cm.seq_lens.cpu())[:b].numpy().astype(np.int64)
        table = cm.block_table_tensor[:b]
        n = qs[1:] - qs[:-1]
        self.slots.release(STEP.take_released())
        slots = self.slots.assign(row_keys(table, n), lens - n)
        if self.static is not None and b <= self.static.rows and is_static_batch(n, cm.num_actual_tokens):
            plan = static_plan(self.mp.geometry, lens, slots, n, self.slots.scratch, table.shape[1])
            self.static.load(plan, table)
            return RotkvMetadata(None, table, cm.num_actual_tokens, self.static, b)
        plan = plan_step(self.mp.geometry, qs, lens, slots, table.shape[1])
        return RotkvMetadata(plan, table, cm.num_actual_tokens)


_FALLBACK_SAID: list = []


def row_keys(table: torch.Tensor, num_tokens: np.ndarray) -> list:
    """The side-pool keys of a step's rows (``table``: vLLM's block table of the rows, ``num_tokens``: their new
    tokens): the request ids the hooked model runner names (:mod:`rotkv.integrations.vllm.runner`), None for a
    row of no request (padding rows of a full graph, which have no token; every row of a dummy or capture run)."""
    b = len(num_tokens)
    if STEP.mode == "dummy":
        return [None] * b
    if STEP.mode == "step" and STEP.keys is not None:
        keys = STEP.keys
        if len(keys) > b:
            raise RuntimeError(f"rotkv: the attention metadata holds {b} of the step's {len(keys)} requests (vLLM "
                               f"split the step into micro-batches); rotkv's backend does not support dual-batch "
                               f"overlap: leave --enable-dbo off")
        keys = keys + [None] * (b - len(keys))
    else:
        # Fallback where no hooked runner names the rows (a model runner the hooks do not know): the requests'
        # first block ids, read from the device. This copy makes the host wait for the GPU's previous step.
        if not _FALLBACK_SAID:
            _FALLBACK_SAID.append(True)
            import logging

            logging.getLogger("vllm.rotkv").warning(
                "rotkv: no hooked vLLM model runner names this step's requests; the side pool is keyed by their "
                "first block ids, read from the GPU every step (hooked: %s)", ", ".join(RUNNERS))
        keys = [k if k != 0 else None for k in table[:, 0].cpu().tolist()]  # block 0: vLLM's null block
    return [None if m == 0 else k for k, m in zip(keys, np.asarray(num_tokens).tolist())]


class RotkvAttentionImpl(AttentionImpl[RotkvMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **kwargs):
        why = []
        if alibi_slopes is not None:
            why.append("ALiBi")
        if sliding_window is not None:
            why.append("sliding-window attention")
        if logits_soft_cap:
            why.append("logits soft-capping")
        if attn_type != AttentionType.DECODER:
            why.append(f"attention type {attn_type}")
        if kv_sharing_target_layer_name is not None:
            why.append("KV sharing between layers")
        if kv_cache_dtype != "auto":
            why.append(f"kv_cache_dtype={kv_cache_dtype!r} (rotkv stores INT2 itself: leave it 'auto')")
        if why:
            raise ValueError("rotkv's vLLM backend does not support " + ", ".join(why))
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.mp = model_plan()
        # vLLM's config is current while the model is built, not during its forwards: read it here
        self.max_num_seqs = get_current_vllm_config().scheduler_config.max_num_seqs
        self._layer: dict = {}  # this layer's index, rotation, codecs, layout, side pool: on first forward
        self._body = None

    def _setup(self, layer, device, dtype) -> dict:
        if self._layer:
            return self._layer
        mp = self.mp
        i = layer_index(layer.layer_name)
        rot = shard_rotation(mp.rotations[i], mp.total_kv_heads, mp.tp_size, mp.tp_rank).to(device)
        layout = mp.layouts[i]
        if layout.kv_heads != self.num_kv_heads or layout.head_dim != self.head_size:
            raise ValueError(f"rotkv: layer {i} has {self.num_kv_heads} KV heads of {self.head_size} dims on this "
                             f"rank, "
                             f"the plan {layout.kv_heads} of {layout.head_dim}")
        geo = mp.geometry
        slots = self.max_num_seqs + mp.settings.spare_slots
        sdt = _tier_dtype(mp.settings.spec.tier_dtype, dtype)
        shape = ((slots + 1) * geo.slot_pages, self.num_kv_heads, geo.page, self.head_size)
        # the side pool: allocated in vLLM's profiling run (the first forward), so its memory is not KV budget
        side = (torch.zeros(shape, dtype=sdt, device=device), torch.zeros(shape, dtype=sdt, device=device))
        # the refine rings (a preset with refine_tokens): K slots for every side-pool slot, allocated with it
        refine = slot_rings(mp.settings.spec, mp.codecs[i], geo, self.num_kv_heads, self.head_size, slots + 1, device)
        self._layer = dict(index=i, rot=rot, codecs=mp.codecs[i], layout=layout, side=side, refine=refine,
                           page_bytes=mp.slot_bytes * geo.page * self.num_kv_heads)
        return self._layer

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{WHERE}: rotkv's backend does not fuse output quantization")
        st = self._setup(layer, query.device, query.dtype)
        if attn_metadata is None or kv_cache.numel() == 0:  # vLLM's profiling run: no cache yet
            return output.fill_(0)
        key_ = (kv_cache.data_ptr(), kv_cache.numel())
        if self._body is None or self._body[0] != key_:
            n = blocks_in(kv_cache, st["page_bytes"])
            self._body = (key_, st["layout"].body(kv_cache, n))
        if attn_metadata.static is not None:  # a decode batch on the fixed buffers (captured in a full graph)
            b = attn_metadata.rows
            static_step(attn_metadata.static, b, query, key, value, self._body[1], *st["side"], st["rot"],
                        st["codecs"], self.scale, output, st["refine"])
            if output.shape[0] > b:
                output[b:].zero_()
            return output
        plan = attn_metadata.plan
        t = plan.num_tokens
        layer_step(plan, self.mp.geometry, query, key, value, self._body[1], *st["side"], attn_metadata.block_table,
                   st["rot"], st["codecs"], self.scale, output, st["refine"])
        if output.shape[0] > t:
            output[t:].zero_()
        return output

"""Decoder-only transformers (Llama 2/3, Qwen 2/2.5/3, Gemma 1/2/3, and the mixtures of
experts Qwen3-MoE, Mixtral and gpt-oss) as Flax NNX modules.

One module, not one per family: the families differ by switches in ModelConfig (q/k/v bias,
q/k norms, (1 + w) norms, embedding scale, sandwich norms, softcaps, sliding windows, local
rope, attention sinks, a sparse MLP of experts: models/experts.py, whose router statistics the
layer scan carries beside the residual stream). Layers (models/blocks.py) are stacked and run
under ``jax.lax.scan``, rematerialised as the run's remat policy says; what differs from layer
to layer (window size, which rope) is a scanned array, never a Python branch over layers.

A model knows where it came from through one static attribute, ``provenance``
(models/provenance.py), empty for a model built directly.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxtune.models import moe, rope
from jaxtune.models.blocks import MLP, PROJECTIONS, Attention, Block
from jaxtune.models.config import SLIDING, ModelConfig
from jaxtune.models.layers import Embed, Linear, RMSNorm
from jaxtune.models.lora import LoraConfig
from jaxtune.models.provenance import EMPTY, Provenance
from jaxtune.parallel import pipeline, sharding
from jaxtune.parallel.runtime import DEFAULT, Runtime

# What a layer's backward pass reads, so that remat="activations" recomputes no matmul and no
# attention, only elementwise work (norms, rope, the MLP activation): the attention's inputs
# and output (and its softmax statistics, saved by the kernels' own names or, for cuDNN, as the
# outputs of its forward primitive), the residual stream between attention and MLP, the MLP's
# gate and up projections, each LoRA's x @ A, and the inputs of the norms that follow a
# projection (q/k norms, sandwich norms).
SAVED_ACTIVATIONS = (
  "query",
  "key",
  "value",
  "query_projected",
  "key_projected",
  "attention_out",
  "attention_lse",
  "residual_mid",
  "attention_projected",
  "mlp_gate",
  "mlp_up",
  "mlp_out",
  "lora_a",
)


def _cudnn_attention_outputs(prim, *_, **__) -> bool:
  return prim.name.startswith("dot_product_attention_fwd")


def _offload_only(name: str):
  """The remat policy that keeps only the values named ``name``, in pinned host memory."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[name],
    offload_src="device",
    offload_dst="pinned_host",
  )


REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  # As "full"; the NF4 products' input gradients also dequantize their weights anew
  # (Runtime.dequantize_again).
  "lean": jax.checkpoint_policies.nothing_saveable,
  "activations": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(*SAVED_ACTIVATIONS), _cudnn_attention_outputs
  ),
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  # As "full", but each layer's input (the residual stream the backward pass restarts from)
  # waits in pinned host memory instead of on the device.
  "offload": _offload_only("layer_input"),
}

# --remat-group N (Runtime.remat_group > 1): the remat settings that take it, and what each
# keeps of a group of N layers (its input; on the host under offload). Inside a group each
# layer keeps nothing but its input, which the group's backward recomputes.
GROUP_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "lean": jax.checkpoint_policies.nothing_saveable,
  "offload": _offload_only("group_input"),
}
_IN_GROUP = jax.checkpoint_policies.nothing_saveable


class Decoder(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    quantized: bool = False,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike | None = None,
    provenance: Provenance = EMPTY,
    rngs: nnx.Rngs,
  ):
    param_dtype = param_dtype or dtype
    self.config = cfg
    self.dtype = dtype
    self.quantized = quantized
    self.provenance = provenance  # static (in the graphdef): where the weights came from
    self.lora_config: LoraConfig | None = None  # the adapters' settings, set by apply_lora
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=param_dtype, rngs=rngs)
    self.layers = Block(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.norm = RMSNorm(
      cfg.hidden_size,
      eps=cfg.rms_norm_eps,
      plus_one=cfg.norm_plus_one,
      f32_scale=cfg.norm_scale_f32,
      param_dtype=param_dtype,
    )
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Linear(
        cfg.hidden_size,
        cfg.vocab_size,
        axes=("vocab", "embed"),
        quantized=False,
        param_dtype=param_dtype,
        rngs=rngs,
      )

  def per_layer(self) -> tuple[np.ndarray, np.ndarray]:
    """(window [L] int32, 0 = full attention; local [L] bool: uses the local rope)."""
    cfg = self.config
    sliding = np.array([t == SLIDING for t in cfg.layer_types] or [False] * cfg.num_layers)
    window = np.where(sliding, cfg.sliding_window or 0, 0).astype(np.int32)
    return window, sliding & (cfg.rope_local is not None)

  def embed(
    self, input_ids: jax.Array, positions: jax.Array, inputs_embeds: jax.Array | None = None
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """(embedded tokens [B, T, D], global rope (cos, sin), local rope (cos, sin)).
    ``inputs_embeds``: the rows of the embedding table for ``input_ids``, gathered elsewhere
    (``--embeddings host``); the table itself is then not read."""
    cfg = self.config
    if inputs_embeds is None:
      x = self.embed_tokens(input_ids, self.dtype)
    else:
      x = inputs_embeds.astype(self.dtype)
    if cfg.embed_scale:  # Gemma rounds sqrt(hidden) to the compute dtype first
      x = x * jnp.asarray(math.sqrt(cfg.hidden_size), self.dtype)
    ropes = (cfg.rope, cfg.rope_local or cfg.rope)
    cos_sin = [
      rope.cos_sin(
        positions,
        rope.inverse_frequencies(r, cfg.head_dim),
        self.dtype,
        rope.attention_scaling(r, cfg.head_dim),
      )
      for r in ropes
    ]
    return x, cos_sin[0], cos_sin[1]

  def _layers(
    self, x, rope_global, rope_local, segment_ids, positions, dropout_key, runtime: Runtime
  ):
    """Run the stacked layers under scan (training and plain forward); pipelined over the
    mesh's ``pipe`` axis when it has one (pipeline.py). The layers' output and, for a mixture
    of experts, their router statistics summed (experts.SparseMLP; None otherwise)."""
    window, local = self.per_layer()
    n = self.config.num_layers
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, n)
    graphdef, state = nnx.split(self.layers)
    sparse = self.config.is_moe

    def step(carry, xs, side):
      # A sparse model's carry holds its router statistics beside the residual stream.
      x, stats = carry if sparse else (carry, None)
      layer_state, key, w, is_local = xs
      (cos_g, sin_g), (cos_l, sin_l), seg, pos = side
      # The residual stream's layout at each block boundary.
      x = runtime.constrain(x, "batch", "norm_length", "embed")
      if runtime.shard_frozen:
        here = jax.sharding.get_abstract_mesh()  # inside the pipeline's shard_map: its mesh
        layer_state = sharding.gathered(layer_state, runtime.mesh if here.empty else here)
      x = checkpoint_name(x, "layer_input")  # what remat="offload" keeps on the host
      c = jnp.where(is_local, cos_l, cos_g)
      s = jnp.where(is_local, sin_l, sin_g)
      out = nnx.merge(graphdef, layer_state)(x, c, s, seg, w, key, runtime, positions=pos)
      return (out[0], stats + out[1]) if sparse else out

    def scan(body, x, xs):
      """x through body(x, xs[i]) for each i, under scan or (scan_layers off) a loop."""
      if runtime.scan_layers:
        return jax.lax.scan(lambda x, xs: (body(x, xs), None), x, xs)[0]
      for i in range(jax.tree.leaves(xs)[0].shape[0]):
        x = body(x, jax.tree.map(lambda a, i=i: a[i], xs))
      return x

    def layer_at(x, i, xs, side):
      """Layer ``i``, indexing the whole stack: no weights sliced out into a copy. Indexed
      inside a checkpoint, so its weights are not saved for the backward pass."""
      return step(x, jax.tree.map(lambda a: a[i], xs), side)

    group = runtime.remat_group
    if group == 1 and runtime.kept_layers:
      # The first kept_layers layers keep their activations, the rest (remat full) only their
      # inputs: two scans.
      kept = runtime.kept_layers
      policies = (REMAT_POLICIES["activations"], REMAT_POLICIES[runtime.remat])
      steps = [jax.checkpoint(layer_at, policy=p, prevent_cse=False) for p in policies]

      def run(x, xs, side):
        layers = jax.tree.leaves(xs)[0].shape[0]
        if kept >= layers:
          raise ValueError(f"kept_layers {kept} must be fewer than the {layers} layers")
        for f, ids in zip(steps, (jnp.arange(kept), jnp.arange(kept, layers)), strict=True):
          x = scan(lambda x, i, f=f: f(x, i, xs, side), x, ids)
        return x
    elif group == 1:
      if runtime.remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[runtime.remat], prevent_cse=False)

      def run(x, xs, side):
        return scan(lambda x, xs: step(x, xs, side), x, xs)
    else:
      # Layers in groups of ``group``: only each group's input is kept (on the host under
      # offload); a group's backward recomputes its layers from it, keeping their inputs.
      group_layer = jax.checkpoint(layer_at, policy=_IN_GROUP, prevent_cse=False)

      def one_group(x, first, xs, side):
        x = checkpoint_name(x, "group_input")
        return scan(lambda x, i: group_layer(x, first + i, xs, side), x, jnp.arange(group))

      one_group = jax.checkpoint(one_group, policy=GROUP_POLICIES[runtime.remat], prevent_cse=False)

      def run(x, xs, side):
        layers = jax.tree.leaves(xs)[0].shape[0]
        if layers % group:  # a[first + i] past the end would clamp: the last layer again
          raise ValueError(f"remat_group {group} does not divide the {layers} layers")
        firsts = jnp.arange(0, layers, group)
        return scan(lambda x, first: one_group(x, first, xs, side), x, firsts)

    xs = (state, layer_keys, jnp.asarray(window), jnp.asarray(local))
    side = (rope_global, rope_local, segment_ids, positions)
    if sparse:  # (resolve refuses pipelines and layer groups for these)
      return run((x, jnp.zeros((2, self.config.num_experts), jnp.float32)), xs, side)
    if not runtime.pipelined:
      return run(x, xs, side), None

    def stage(x, xs, side, j):
      state, keys, w, is_local = xs
      if keys is not None:  # each micro-batch its own dropout masks
        keys = jax.vmap(lambda k: jax.random.fold_in(k, j))(keys)
        if runtime.manual_stages and runtime.size("data") > 1:  # a shard's rows, its masks
          shard = jax.lax.axis_index("data")
          keys = jax.vmap(lambda k: jax.random.fold_in(k, shard))(keys)
      return run(x, (state, keys, w, is_local), side)

    mesh = runtime.mesh
    x = pipeline.gpipe(
      stage, xs, x, side, mesh=mesh, microbatches=runtime.microbatches,
      manual=runtime.manual_stages,
    )  # fmt: skip
    return jax.lax.with_sharding_constraint(x, sharding.after_pipeline(mesh, x.shape[0])), None

  def hidden_states(
    self,
    input_ids: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    runtime: Runtime = DEFAULT,
    inputs_embeds: jax.Array | None = None,
  ) -> jax.Array:
    """Final-norm hidden states [B, T, D] in the compute dtype, computed as ``runtime`` says.
    ``inputs_embeds``: the embedding rows of ``input_ids`` [B, T, D], gathered elsewhere."""
    return self.hidden_and_balance(
      input_ids, positions, segment_ids, dropout_key, runtime, inputs_embeds
    )[0]

  def hidden_and_balance(
    self,
    input_ids: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    runtime: Runtime = DEFAULT,
    inputs_embeds: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array | None]:
    """(``hidden_states``, the load-balancing loss over every layer's router and the tokens
    that are no padding, as transformers' ``load_balancing_loss_func`` computes it; None for
    a model without experts)."""
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    x, rope_global, rope_local = self.embed(input_ids, positions, inputs_embeds)
    h, stats = self._layers(
      x, rope_global, rope_local, segment_ids, positions, dropout_key, runtime
    )
    balance = None
    if stats is not None:
      rows = jnp.sum(segment_ids != 0) * self.config.num_layers
      balance = moe.balance_loss(stats, rows)
    return self.norm(h), balance

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:
    with jax.named_scope("output_layer"):
      logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
      return self._final_softcap(logits)

  def logits_piece(self, h: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """``logits_from_hidden`` for vocabulary entries ``start .. start + size - 1`` only."""
    if self.lm_head is None:
      logits = self.embed_tokens.attend(h, start, size)
    else:
      logits = self.lm_head.rows(h, start, size)
    return self._final_softcap(logits)

  def _final_softcap(self, logits: jax.Array) -> jax.Array:
    cap = self.config.final_logit_softcap
    return cap * jnp.tanh(logits / cap) if cap else logits

  def __call__(
    self,
    input_ids: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    runtime: Runtime = DEFAULT,
    inputs_embeds: jax.Array | None = None,
  ) -> jax.Array:
    """Logits [B, T, V] in float32."""
    h = self.hidden_states(input_ids, positions, segment_ids, dropout_key, runtime, inputs_embeds)
    return self.logits_from_hidden(h).astype(jnp.float32)


__all__ = [
  "GROUP_POLICIES",
  "MLP",
  "PROJECTIONS",
  "REMAT_POLICIES",
  "SAVED_ACTIVATIONS",
  "Attention",
  "Block",
  "Decoder",
]

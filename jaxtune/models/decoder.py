"""Decoder-only transformers (Llama 2/3, Qwen 2/2.5/3, Gemma 1/2/3) as Flax NNX modules.

One module, not one per family: the families differ by switches in ModelConfig (q/k/v bias,
q/k norms, (1 + w) norms, embedding scale, sandwich norms, softcaps, sliding windows, local
rope). Layers are stacked and run under ``jax.lax.scan``; what differs from layer to layer
(window size, which rope) is a scanned array, never a Python branch over layers.

Module and attribute names follow transformers' (``layers.self_attn.q_proj``), so the
converter table and LoRA targets read the same as a PEFT config.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxtune.models import attention, rope
from jaxtune.models.config import SLIDING, ModelConfig
from jaxtune.models.layers import Embed, Linear, RMSNorm, lora_inputs
from jaxtune.parallel import pipeline, sharding
from jaxtune.parallel.runtime import DEFAULT, Runtime

# The order fixes which fold_in index each projection's LoRA dropout key gets.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_AXES = {
  "q_proj": ("heads", "embed"),
  "k_proj": ("kv_heads", "embed"),
  "v_proj": ("kv_heads", "embed"),
  "o_proj": ("embed", "heads"),
  "gate_proj": ("mlp", "embed"),
  "up_proj": ("mlp", "embed"),
  "down_proj": ("embed", "mlp"),
}

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

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _linear(cfg: ModelConfig, name: str, *, quantized, param_dtype, rngs, bias=False):
  out_features, in_features = cfg.linear_shapes()[name]
  return Linear(
    in_features,
    out_features,
    axes=_AXES[name],
    quantized=quantized,
    use_bias=bias,
    layers=cfg.num_layers,
    param_dtype=param_dtype,
    rngs=rngs,
  )


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype: DTypeLike, rngs: nnx.Rngs):
    kw = dict(quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = _linear(cfg, "q_proj", bias=cfg.qkv_bias, **kw)
    self.k_proj = _linear(cfg, "k_proj", bias=cfg.qkv_bias, **kw)
    self.v_proj = _linear(cfg, "v_proj", bias=cfg.qkv_bias, **kw)
    self.o_proj = _linear(cfg, "o_proj", bias=cfg.o_bias, **kw)
    self.qkv_fused = nnx.data(None)  # a layers.Fused while decoding (prepare_kernel_operands)
    if cfg.qk_norm:
      norm = dict(eps=cfg.rms_norm_eps, layers=cfg.num_layers, plus_one=cfg.norm_plus_one)
      self.q_norm = RMSNorm(cfg.head_dim, **norm, param_dtype=param_dtype)
      self.k_norm = RMSNorm(cfg.head_dim, **norm, param_dtype=param_dtype)
    else:
      self.q_norm = self.k_norm = None
    self.num_heads = cfg.num_heads
    self.num_kv_heads = cfg.num_kv_heads
    self.head_dim = cfg.head_dim
    self.scale = cfg.attention_scale
    self.softcap = cfg.attn_logit_softcap

  def __call__(
    self,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    segment_ids: jax.Array | None,
    window: jax.Array | None,
    keys: Sequence[jax.Array | None],
    runtime: Runtime,
    cache: Callable[..., tuple[jax.Array, Any]] | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array | tuple[jax.Array, Any]:
    """With ``cache``, a function (q, k, v, scale, softcap) -> (out, new cache) that stores
    this chunk's keys and attends over the cached ones, returns (out, new cache).
    ``positions`` [B, T]: what ring attention masks by (a ``context`` axis)."""
    b, t, _ = x.shape
    mm, again = runtime.nf4_matmul, runtime.dequantize_again
    fq = fk = fv = None
    if self.qkv_fused is not None:
      fq, fk, fv = self.qkv_fused(x, mm)
    q = self.q_proj(x, keys[0], mm, fq, again).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x, keys[1], mm, fk, again).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x, keys[2], mm, fv, again).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:  # its backward reads the projections (remat="activations")
      q, k = checkpoint_name(q, "query_projected"), checkpoint_name(k, "key_projected")
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    if cache is None:
      q, k, v = (checkpoint_name(a, n) for a, n in ((q, "query"), (k, "key"), (v, "value")))
      out = attention.attention(  # [B, T, N, H], its ops under the "attention" scope
        q,
        k,
        v,
        segment_ids=segment_ids,
        scale=self.scale,
        window=window,
        softcap=self.softcap,
        runtime=runtime,
        positions=positions,
      )
    else:  # the decoder decides where keys are kept and which it attends to
      out, cache = cache(q, k, v, self.scale, self.softcap)
    out = self.o_proj(out.reshape(b, t, -1), keys[3], mm, dequantize_again=again)
    return out if cache is None else (out, cache)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype: DTypeLike, rngs: nnx.Rngs):
    kw = dict(quantized=quantized, param_dtype=param_dtype, rngs=rngs, bias=cfg.mlp_bias)
    self.gate_proj = _linear(cfg, "gate_proj", **kw)
    self.up_proj = _linear(cfg, "up_proj", **kw)
    self.down_proj = _linear(cfg, "down_proj", **kw)
    self.gate_up_fused = nnx.data(None)  # a layers.Fused while decoding
    self.activation = cfg.hidden_act

  def __call__(self, x: jax.Array, keys: Sequence[jax.Array | None], runtime: Runtime) -> jax.Array:
    """down(act(gate(x)) * up(x)); with ``runtime.mlp_chunk``, a rematerialised scan over
    pieces of that many tokens (the last one zero-padded; the MLP is per token), so the
    [B, T, intermediate] temporaries exist for one piece at a time (long contexts, where they
    are the largest buffers of a layer's backward). LoRA dropout draws each piece's masks
    from its own key, so with dropout the masks (not their distribution) differ from the
    unchunked run's."""
    b, t, d = x.shape
    c = runtime.mlp_chunk
    if not c or t <= c:
      return self._mlp(x, keys, runtime)
    n = -(-t // c)

    def piece(_, xs):
      x_c, i = xs
      keys_c = [None if k is None else jax.random.fold_in(k, i) for k in keys]
      return None, self._mlp(x_c, keys_c, runtime)

    padded = jnp.pad(x, ((0, 0), (0, n * c - t), (0, 0)))
    pieces = padded.reshape(b, n, c, d).swapaxes(0, 1)
    step = jax.checkpoint(piece, prevent_cse=False)
    _, ys = jax.lax.scan(step, None, (pieces, jnp.arange(n)))
    return ys.swapaxes(0, 1).reshape(b, n * c, -1)[:, :t]

  def _mlp(self, x, keys, runtime: Runtime):
    mm, again = runtime.nf4_matmul, runtime.dequantize_again
    fg = fu = lg = lu = None
    if self.gate_up_fused is not None:
      fg, fu = self.gate_up_fused(x, mm)
    else:  # their LoRA products folded into the frozen ones (Linear's lora_in)
      lg, lu = lora_inputs(x, (self.gate_proj, self.up_proj), (keys[4], keys[5]))
    gate = checkpoint_name(self.gate_proj(x, keys[4], mm, fg, again, lg), "mlp_gate")
    up = checkpoint_name(self.up_proj(x, keys[5], mm, fu, again, lu), "mlp_up")
    with jax.named_scope("mlp_activation"):
      h = _ACTIVATIONS[self.activation](gate) * up
    return self.down_proj(h, keys[6], mm, dequantize_again=again)


class Block(nnx.Module):
  """One decoder layer; built with a leading ``layers`` axis and run under scan.

  Llama/Qwen/Gemma 1: x + attn(norm(x)), then + mlp(post_attention_layernorm(x)).
  Gemma 2/3 (sandwich): x + post_attention_layernorm(attn(input_layernorm(x))), then
  + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))).
  """

  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype: DTypeLike, rngs: nnx.Rngs):
    norm = dict(
      eps=cfg.rms_norm_eps,
      layers=cfg.num_layers,
      plus_one=cfg.norm_plus_one,
      param_dtype=param_dtype,
    )
    self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.self_attn = Attention(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
    if cfg.sandwich_norms:
      self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, **norm)
      self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, **norm)
    else:
      self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
    self.mlp = MLP(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)

  def _residual(self, x, runtime: Runtime):
    """The residual stream after an add. Under sequence parallelism its tokens stay split over
    ``tensor``, so the norms and adds run on 1/tensor of the tokens and each projection's
    all-reduce becomes a reduce-scatter + all-gather."""
    if not runtime.sequence_parallel:
      return x
    return runtime.constrain(x, "batch", "norm_length", "embed")

  def __call__(
    self,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    segment_ids: jax.Array | None,
    window: jax.Array | None,
    key: jax.Array | None,
    runtime: Runtime,
    cache: Callable[..., tuple[jax.Array, Any]] | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array | tuple[jax.Array, Any]:
    """The layer's output; with a KV ``cache`` (see Attention), (output, new cache)."""
    keys = [None] * len(PROJECTIONS)
    if key is not None:
      keys = [jax.random.fold_in(key, i) for i in range(len(PROJECTIONS))]
    h = self.self_attn(
      self.input_layernorm(x), cos, sin, segment_ids, window, keys, runtime, cache, positions
    )
    h, new_cache = (h, None) if cache is None else h
    # Decoding (cache) runs on the model as it is: no training layout.
    res = (lambda x: self._residual(x, runtime)) if cache is None else (lambda x: x)  # noqa: E731
    mlp = lambda x: self.mlp(x, keys, runtime)  # noqa: E731
    # The checkpoint names mark what remat="activations" keeps for the backward pass.
    if self.pre_feedforward_layernorm is None:
      x = checkpoint_name(res(x + h), "residual_mid")
      x = res(x + mlp(self.post_attention_layernorm(x)))
    else:
      h = checkpoint_name(h, "attention_projected")
      x = checkpoint_name(res(x + self.post_attention_layernorm(h)), "residual_mid")
      h = checkpoint_name(mlp(self.pre_feedforward_layernorm(x)), "mlp_out")
      x = res(x + self.post_feedforward_layernorm(h))
    return x if cache is None else (x, new_cache)


class Decoder(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    quantized: bool = False,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike | None = None,
    rngs: nnx.Rngs,
  ):
    param_dtype = param_dtype or dtype
    self.config = cfg
    self.dtype = dtype
    self.quantized = quantized
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=param_dtype, rngs=rngs)
    self.layers = Block(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.norm = RMSNorm(
      cfg.hidden_size, eps=cfg.rms_norm_eps, plus_one=cfg.norm_plus_one, param_dtype=param_dtype
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
    cos, sin = rope.cos_sin(positions, rope.inverse_frequencies(cfg.rope, cfg.head_dim), self.dtype)
    local = cfg.rope_local or cfg.rope
    local_cs = rope.cos_sin(positions, rope.inverse_frequencies(local, cfg.head_dim), self.dtype)
    return x, (cos, sin), local_cs

  def _layers(
    self, x, rope_global, rope_local, segment_ids, positions, dropout_key, runtime: Runtime
  ):
    """Run the stacked layers under scan (training and plain forward); pipelined over the
    mesh's ``pipe`` axis when it has one (pipeline.py)."""
    window, local = self.per_layer()
    n = self.config.num_layers
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, n)
    graphdef, state = nnx.split(self.layers)

    def step(x, xs, side):
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
      return nnx.merge(graphdef, layer_state)(x, c, s, seg, w, key, runtime, positions=pos)

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
    if not runtime.pipelined:
      return run(x, xs, side)

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
    return jax.lax.with_sharding_constraint(x, sharding.after_pipeline(mesh, x.shape[0]))

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
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    x, rope_global, rope_local = self.embed(input_ids, positions, inputs_embeds)
    h = self._layers(x, rope_global, rope_local, segment_ids, positions, dropout_key, runtime)
    return self.norm(h)

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

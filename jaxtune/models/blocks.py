"""The layers of the decoder: attention, the gated MLP and the decoder layer (Block) built
from them, each with a leading ``layers`` axis so that models/decoder.py can stack and scan
them.

Module and attribute names follow transformers' (``layers.self_attn.q_proj``), so the
converter table and LoRA targets read the same as a PEFT config. The names given to
activations with ``checkpoint_name`` are those the remat policies of models/decoder.py keep.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxtune.models import attention, rope
from jaxtune.models.config import ModelConfig
from jaxtune.models.experts import SparseMLP
from jaxtune.models.layers import Linear, RMSNorm, lora_inputs
from jaxtune.parallel.runtime import Runtime

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
    if cfg.attention_sinks:  # a logit per head beside the keys' (gpt-oss)
      sinks = jnp.zeros((cfg.num_layers, cfg.num_heads), param_dtype)
      self.sinks = nnx.Param(sinks, axes=("layers", "heads"))
    else:
      self.sinks = None
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
    """With ``cache``, a function (q, k, v, scale, softcap, sinks) -> (out, new cache) that stores
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
    sinks = None if self.sinks is None else self.sinks[...]
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
        sinks=sinks,
      )
    else:  # the decoder decides where keys are kept and which it attends to
      out, cache = cache(q, k, v, self.scale, self.softcap, sinks)
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
      f32_scale=cfg.norm_scale_f32,
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
    kw = dict(quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.sparse = cfg.is_moe
    self.mlp = SparseMLP(cfg, **kw) if cfg.is_moe else MLP(cfg, **kw)

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
    """The layer's output; with a KV ``cache`` (see Attention), (output, new cache); for a
    sparse MLP without a cache, (output, router statistics [2, E]: experts.SparseMLP)."""
    keys = [None] * len(PROJECTIONS)
    if key is not None:
      keys = [jax.random.fold_in(key, i) for i in range(len(PROJECTIONS))]
    h = self.self_attn(
      self.input_layernorm(x), cos, sin, segment_ids, window, keys, runtime, cache, positions
    )
    h, new_cache = (h, None) if cache is None else h
    # Decoding (cache) runs on the model as it is: no training layout.
    res = (lambda x: self._residual(x, runtime)) if cache is None else (lambda x: x)  # noqa: E731
    stats = []

    def mlp(x):
      if not self.sparse:
        return self.mlp(x, keys, runtime)
      valid = None if segment_ids is None else segment_ids != 0
      y, s = self.mlp(x, valid, runtime.grouped_matmul)
      stats.append(s)
      return y

    # The checkpoint names mark what remat="activations" keeps for the backward pass.
    if self.pre_feedforward_layernorm is None:
      x = checkpoint_name(res(x + h), "residual_mid")
      x = res(x + mlp(self.post_attention_layernorm(x)))
    else:
      h = checkpoint_name(h, "attention_projected")
      x = checkpoint_name(res(x + self.post_attention_layernorm(h)), "residual_mid")
      h = checkpoint_name(mlp(self.pre_feedforward_layernorm(x)), "mlp_out")
      x = res(x + self.post_feedforward_layernorm(h))
    if cache is not None:
      return x, new_cache
    return (x, stats[0]) if self.sparse else x

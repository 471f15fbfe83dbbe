"""Llama 2 / 3 / 3.1 / 3.2 as Flax NNX modules with stacked, scanned layers.

Module and attribute names follow transformers' (``layers.self_attn.q_proj``), so the
converter table and LoRA targets read the same as a PEFT config.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune import attention, rope
from jaxtune.config import ModelConfig
from jaxtune.layers import Embed, Linear, RMSNorm

# Which projections' LoRA dropout keys come from which fold_in index, and their axes.
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

REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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
  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype, rngs: nnx.Rngs):
    kw = dict(quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = _linear(cfg, "q_proj", bias=cfg.attention_bias, **kw)
    self.k_proj = _linear(cfg, "k_proj", bias=cfg.attention_bias, **kw)
    self.v_proj = _linear(cfg, "v_proj", bias=cfg.attention_bias, **kw)
    self.o_proj = _linear(cfg, "o_proj", bias=cfg.attention_bias, **kw)
    self.attention_impl = "xla"  # set for the whole model by Llama.set_runtime
    self.num_heads = cfg.num_heads
    self.num_kv_heads = cfg.num_kv_heads
    self.head_dim = cfg.head_dim

  def __call__(self, x, cos, sin, mask, keys):
    b, t, _ = x.shape
    q = self.q_proj(x, keys[0]).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x, keys[1]).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x, keys[2]).reshape(b, t, self.num_kv_heads, self.head_dim)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    out = attention.attention(  # [B, T, N, H]
      q, k, v, mask, scale=self.head_dim**-0.5, implementation=self.attention_impl
    )
    return self.o_proj(out.reshape(b, t, -1), keys[3])


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype, rngs: nnx.Rngs):
    kw = dict(quantized=quantized, param_dtype=param_dtype, rngs=rngs, bias=cfg.mlp_bias)
    self.gate_proj = _linear(cfg, "gate_proj", **kw)
    self.up_proj = _linear(cfg, "up_proj", **kw)
    self.down_proj = _linear(cfg, "down_proj", **kw)

  def __call__(self, x, keys):
    h = jax.nn.silu(self.gate_proj(x, keys[4])) * self.up_proj(x, keys[5])
    return self.down_proj(h, keys[6])


class Block(nnx.Module):
  """One decoder layer; built with a leading ``layers`` axis and run under scan."""

  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype, rngs: nnx.Rngs):
    norm = dict(eps=cfg.rms_norm_eps, layers=cfg.num_layers, param_dtype=param_dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.self_attn = Attention(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.mlp = MLP(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, cos, sin, mask, key):
    keys = [None] * len(PROJECTIONS)
    if key is not None:
      keys = [jax.random.fold_in(key, i) for i in range(len(PROJECTIONS))]
    x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, keys)
    return x + self.mlp(self.post_attention_layernorm(x), keys)


class Llama(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    quantized: bool = False,
    dtype=jnp.float32,
    param_dtype=None,
    rngs: nnx.Rngs,
  ):
    param_dtype = param_dtype or dtype
    self.config = cfg
    self.dtype = dtype
    self.quantized = quantized
    self.remat = "none"  # a key of REMAT_POLICIES; the trainer sets it
    self.scan_layers = True
    # Sharding of the residual stream [B, T, D], constrained at each block boundary.
    self.activation_sharding = None
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=param_dtype, rngs=rngs)
    self.layers = Block(cfg, quantized=quantized, param_dtype=param_dtype, rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
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

  def hidden_states(self, input_ids, positions=None, segment_ids=None, dropout_key=None):
    """Final-norm hidden states [B, T, D] in the compute dtype."""
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    x = self.embed_tokens(input_ids, self.dtype)
    inv_freq = rope.inverse_frequencies(self.config.rope, self.config.head_dim)
    cos, sin = rope.cos_sin(positions, inv_freq, self.dtype)
    mask = attention.make_mask(segment_ids)
    n = self.config.num_layers
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, n)

    graphdef, state = nnx.split(self.layers)

    def step(x, xs):
      layer_state, key = xs
      if self.activation_sharding is not None:
        x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
      return nnx.merge(graphdef, layer_state)(x, cos, sin, mask, key), None

    if self.remat != "none":
      step = jax.checkpoint(step, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
    if self.scan_layers:
      x, _ = jax.lax.scan(step, x, (state, layer_keys))
    else:
      for i in range(n):
        pick = lambda a, i=i: a[i]
        key_i = None if layer_keys is None else layer_keys[i]
        x, _ = step(x, (jax.tree.map(pick, state), key_i))
    return self.norm(x)

  def set_runtime(self, *, remat=None, attention_impl=None, activation_sharding=None):
    """Runtime choices that change how, not what, the model computes."""
    if remat is not None:
      if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}.")
      self.remat = remat
    if attention_impl is not None:
      if attention_impl not in attention.IMPLEMENTATIONS:
        raise ValueError(
          f"attention must be one of {', '.join(attention.IMPLEMENTATIONS)}, "
          f"got {attention_impl!r}."
        )
      self.layers.self_attn.attention_impl = attention_impl
    self.activation_sharding = activation_sharding

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:
    if self.lm_head is None:
      return self.embed_tokens.attend(h)
    return self.lm_head(h)

  def __call__(self, input_ids, positions=None, segment_ids=None, dropout_key=None):
    """Logits [B, T, V] in float32."""
    h = self.hidden_states(input_ids, positions, segment_ids, dropout_key)
    return self.logits_from_hidden(h).astype(jnp.float32)

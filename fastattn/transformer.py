"""Transformer pieces built on the fused kernel: positional encoding and multi-head attention.

``positional_encoding`` is the sinusoidal encoding of "Attention Is All You Need";
``MultiHeadAttention`` is the layer around scaled dot-product attention (projections,
heads split and merged, output projection), loadable from PyTorch
``nn.MultiheadAttention`` weights.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import numpy as np

from . import _validation as _v
from ._api import attention, attention_weights

__all__ = ["positional_encoding", "MultiHeadAttention"]


# ------------------------------------------------------------------------- arguments

def _check_float_dtype(dtype, name: str = "dtype") -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a floating dtype such as numpy.float32, "
                        f"got {dtype!r}") from None
    if not ((dt.kind == "f" and dt.itemsize <= 8) or _v.is_bfloat16(dt)):
        raise TypeError(
            f"{name} must be float16, float32, float64 or bfloat16, got {dt}")
    return dt.newbyteorder("=")


# ------------------------------------------------------------------ positional encoding

def positional_encoding(length, d_model, *, base=10000.0, dtype=np.float32):
    """The sinusoidal positional encoding of "Attention Is All You Need".

    ``PE[pos, 2i] = sin(pos / base**(2i / d_model))`` and
    ``PE[pos, 2i + 1] = cos(pos / base**(2i / d_model))``.

    Parameters
    ----------
    length : int
        Number of positions (``>= 0``).
    d_model : int
        Width of the encoding (``>= 0``); an odd width ends with a sine column.
    base : float, default 10000.0
        The base of the geometric progression of wavelengths (``> 0``).
    dtype : float dtype, default numpy.float32
        Dtype of the result; the values are computed in float64 and rounded once.

    Returns
    -------
    pe : ndarray of shape (length, d_model)
        Add it to embeddings of shape ``(..., length, d_model)``.

    Raises
    ------
    TypeError
        ``length`` or ``d_model`` not an integer, ``base`` not a real number, or
        ``dtype`` not a floating dtype.
    ValueError
        A negative ``length`` or ``d_model``, or ``base <= 0``.
    MemoryError
        The computation needs more memory than the machine has.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import positional_encoding
    >>> pe = positional_encoding(3, 4, dtype=np.float64)
    >>> pe.shape
    (3, 4)
    >>> pe[1].round(4)      # sin 1, cos 1, sin 0.01, cos 0.01
    array([0.8415, 0.5403, 0.01  , 1.    ])
    """
    length = _v.check_int(length, "length", 0)
    d_model = _v.check_int(d_model, "d_model", 0)
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a real number, got {base!r}")
    if not base > 0:
        raise ValueError(f"base must be > 0, got {base}")
    dtype = _check_float_dtype(dtype)
    _check_fits(4 * 8 * length * max(d_model, 1), f"positional_encoding({length}, {d_model})")
    pos = np.arange(length, dtype=np.float64)[:, None]
    two_i = 2 * (np.arange(d_model) // 2)                  # 0, 0, 2, 2, 4, 4, ...
    angle = pos / np.power(float(base), two_i / max(d_model, 1))
    pe = np.where(np.arange(d_model) % 2 == 0, np.sin(angle), np.cos(angle))
    return pe.astype(dtype)


def _check_fits(nbytes, what):
    """MemoryError where a computation's arrays would exceed the machine's memory:
    where the OS overcommits, NumPy's allocation would succeed and the process be
    killed when it fills the pages."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):      # not POSIX: NumPy's own check
        return
    if nbytes > memory > 0:
        raise MemoryError(f"{what} needs about {nbytes / 2**30:.3g} GiB of memory; "
                          f"this machine has {memory / 2**30:.3g} GiB")


# ------------------------------------------------------------------ multi-head attention

_PACKED = ("in_proj_weight",)
_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_BIASES = ("in_proj_bias", "out_proj.bias")


class MultiHeadAttention:
    """Multi-head scaled dot-product attention with learned projections.

    ``out = concat_h(attention(q W_q,h, k W_k,h, v W_v,h)) @ w_o.T + b_o``: the query,
    key and value are projected (a linear map is ``y = x @ w.T + b``), split into
    ``num_heads`` heads of width ``embed_dim // num_heads``, attended with the fused
    kernel ``fastattn.attention`` (scale ``1 / sqrt(head_dim)``), merged and projected
    again. The weights use PyTorch ``nn.MultiheadAttention``'s layout.

    Parameters
    ----------
    embed_dim : int
        Width of the query and of the output; a multiple of ``num_heads``.
    num_heads : int
        Number of heads.
    kdim, vdim : int, optional
        Widths of the key and value inputs (default ``embed_dim``).
    bias : bool, default True
        Whether the four projections have a bias.
    dtype : float dtype, default numpy.float32
        Dtype of the weights.
    seed : int, numpy.random.Generator or None
        Seed of the initialisation; the same seed gives the same weights.

    Attributes
    ----------
    w_q : ndarray of shape (embed_dim, embed_dim)
    w_k : ndarray of shape (embed_dim, kdim)
    w_v : ndarray of shape (embed_dim, vdim)
    w_o : ndarray of shape (embed_dim, embed_dim)
    b_q, b_k, b_v, b_o : ndarray of shape (embed_dim,), or None when ``bias=False``
    embed_dim, num_heads, head_dim, kdim, vdim : int

    Raises
    ------
    ValueError
        ``embed_dim`` not divisible by ``num_heads``, or a size below 1.
    TypeError
        A size that is not an integer, or ``dtype`` not a floating dtype.

    Notes
    -----
    Initialisation follows PyTorch's distributions (not its random numbers): the
    input projections are Xavier-uniform (over the packed ``(3 E, E)`` matrix when
    ``kdim == vdim == embed_dim``, else per matrix), ``w_o`` is uniform in
    ``±1/sqrt(embed_dim)``, and the biases are zero. They are drawn in float64 and
    rounded to ``dtype``, so float32 and float64 layers with one seed agree.

    Differences from PyTorch ``nn.MultiheadAttention(batch_first=True)``:

    - ``mask`` is boolean with ``True`` = **may attend**, as everywhere in fastattn.
      PyTorch's boolean ``attn_mask`` means the opposite (``True`` = blocked): pass
      ``mask=~attn_mask``. A PyTorch ``key_padding_mask`` (``True`` = padding) of
      shape ``(batch, Lk)`` becomes ``mask=~key_padding_mask[:, None, None, :]``;
      a float ``attn_mask`` has no equivalent here (use ``fastattn.attention``'s
      ``bias=`` directly).
    - ``need_weights=True`` returns the per-head weights ``(batch, heads, Lq, Lk)``
      (PyTorch's ``average_attn_weights=False``); average over axis 1 for PyTorch's
      default.
    - A query row with no allowed key gets zeros from the attention (PyTorch gives
      NaN), so the layer returns ``b_o`` there.
    - Dropout of the attention weights is per call (``dropout_p`` with an explicit
      ``dropout_seed``), not a module setting; no ``add_bias_kv`` or
      ``add_zero_attn``.

    The threads are those of ``fastattn.attention`` (see ``fastattn.set_num_threads``);
    the projections are NumPy matrix products.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import MultiHeadAttention
    >>> mha = MultiHeadAttention(8, 2, seed=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32)
    >>> out = mha(x)                                  # self-attention
    >>> out.shape, out.dtype
    ((3, 5, 8), dtype('float32'))
    >>> out, w = mha(x, causal=True, need_weights=True)
    >>> w.shape                                       # (batch, heads, Lq, Lk)
    (3, 2, 5, 5)
    >>> bool(np.allclose(w.sum(axis=-1), 1))
    True
    """

    def __init__(self, embed_dim, num_heads, *, kdim=None, vdim=None, bias=True,
                 dtype=np.float32, seed=None):
        self._set_sizes(embed_dim, num_heads, kdim, vdim)
        dtype = _check_float_dtype(dtype)
        rng = np.random.default_rng(seed)
        E, kd, vd = self.embed_dim, self.kdim, self.vdim

        def uniform(bound, shape):
            return rng.uniform(-bound, bound, size=shape).astype(dtype)

        if kd == E and vd == E:
            packed = uniform(np.sqrt(6.0 / (E + 3 * E)), (3 * E, E))
            self.w_q, self.w_k, self.w_v = (packed[i * E:(i + 1) * E].copy()
                                            for i in range(3))
        else:
            self.w_q = uniform(np.sqrt(6.0 / (E + E)), (E, E))
            self.w_k = uniform(np.sqrt(6.0 / (E + kd)), (E, kd))
            self.w_v = uniform(np.sqrt(6.0 / (E + vd)), (E, vd))
        self.w_o = uniform(1.0 / np.sqrt(E), (E, E))
        if bias:
            self.b_q, self.b_k, self.b_v, self.b_o = (np.zeros(E, dtype) for _ in range(4))
        else:
            self.b_q = self.b_k = self.b_v = self.b_o = None

    def _set_sizes(self, embed_dim, num_heads, kdim, vdim):
        self.embed_dim = _v.check_int(embed_dim, "embed_dim", 1)
        self.num_heads = _v.check_int(num_heads, "num_heads", 1)
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads "
                f"({self.num_heads})")
        self.head_dim = self.embed_dim // self.num_heads
        self.kdim = self.embed_dim if kdim is None else _v.check_int(kdim, "kdim", 1)
        self.vdim = self.embed_dim if vdim is None else _v.check_int(vdim, "vdim", 1)

    # ------------------------------------------------------------------ properties

    @property
    def bias(self) -> bool:
        """Whether the projections have biases."""
        return self.b_q is not None

    @property
    def dtype(self) -> np.dtype:
        """The result dtype of the weights."""
        return _v.result_dtype(*self._params())

    def _params(self):
        ws = [self.w_q, self.w_k, self.w_v, self.w_o]
        return ws + ([self.b_q, self.b_k, self.b_v, self.b_o] if self.bias else [])

    def __repr__(self):
        extra = ""
        if self.kdim != self.embed_dim:
            extra += f", kdim={self.kdim}"
        if self.vdim != self.embed_dim:
            extra += f", vdim={self.vdim}"
        if not self.bias:
            extra += ", bias=False"
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, "
                f"num_heads={self.num_heads}{extra}, dtype={self.dtype})")

    # --------------------------------------------------------------------- forward

    def __call__(self, query, key=None, value=None, *, mask=None, causal=False,
                 need_weights=False, window=None, softcap=None, alibi_slopes=None,
                 sinks=None, q_lengths=None, kv_lengths=None, dropout_p=0.0,
                 dropout_seed=None):
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : array_like of shape (batch, Lq, embed_dim)
            A 2-D ``(Lq, embed_dim)`` query is one unbatched sequence; then ``key``
            and ``value`` are 2-D too and the batch axis is left out of the results.
        key : array_like of shape (batch, Lk, kdim), optional
            Defaults to ``query`` (self-attention).
        value : array_like of shape (batch, Lk, vdim), optional
            Defaults to ``key``.
        mask : array_like of bool, optional
            ``True`` = may attend; broadcastable to ``(batch, num_heads, Lq, Lk)``
            (e.g. ``(Lq, Lk)`` for all, ``(batch, 1, 1, Lk)`` for key padding).
            This is the opposite of PyTorch's boolean ``attn_mask``.
        causal : bool or {"top_left", "bottom_right"}, default False
            As in ``fastattn.attention``: ``True`` lets query ``i`` attend to keys
            ``j <= i``.
        need_weights : bool, default False
            Also return the attention weights of every head.
        window, softcap, alibi_slopes, sinks
        q_lengths, kv_lengths, dropout_p, dropout_seed
            Passed to ``fastattn.attention`` (the weights get all but dropout): the
            heads are axis 1, so ``alibi_slopes`` and ``sinks`` are ``(num_heads,)``
            or ``(batch, num_heads)`` and the lengths are ``(batch,)`` (``(1,)`` for
            an unbatched query).

        Returns
        -------
        out : ndarray of shape (batch, Lq, embed_dim)
            In the result dtype of the weights and the inputs (integers count as
            float64).
        weights : ndarray of shape (batch, num_heads, Lq, Lk)
            Only with ``need_weights=True``; every row sums to 1 (less the sink's
            share with ``sinks``), or is zero where the query may attend to no key.
            Before dropout.

        Raises
        ------
        ValueError
            Wrong number of dimensions, last axes that do not match ``embed_dim``,
            ``kdim``, ``vdim``, batch or key counts that differ, or a mask that does
            not broadcast.
        TypeError
            Non-real inputs or a non-boolean mask.
        """
        query = _v.as_real(query, "query")
        key = query if key is None else _v.as_real(key, "key")
        value = key if value is None else _v.as_real(value, "value")
        self._check_inputs(query, key, value)
        unbatched = query.ndim == 2
        if unbatched:
            query, key, value = query[None], key[None], value[None]
        params = self._params()
        result = _v.result_dtype(query, key, value, *params)
        comp = _v.computation_dtype(result)
        B, Lq, _ = query.shape
        Lk = key.shape[1]
        H, D = self.num_heads, self.head_dim
        if mask is not None:
            mask = _v.as_mask(mask)
            if unbatched:
                _v.check_broadcasts_to(mask, (H, Lq, Lk), "mask")
                mask = mask[None]
            else:
                _v.check_broadcasts_to(mask, (B, H, Lq, Lk), "mask")
        causal = _v.parse_causal(causal) or False

        def project(x, w, b):
            y = x.astype(comp, copy=False) @ w.astype(comp, copy=False).T
            if b is not None:
                y += b.astype(comp, copy=False)
            return y

        def split(y):                          # (B, L, E) -> (B, H, L, D)
            return y.reshape(y.shape[0], y.shape[1], H, D).transpose(0, 2, 1, 3)

        q = split(project(query, self.w_q, self.b_q))
        k = split(project(key, self.w_k, self.b_k))
        v = split(project(value, self.w_v, self.b_v))
        variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, q_lengths=q_lengths, kv_lengths=kv_lengths)
        heads = attention(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p,
                          dropout_seed=dropout_seed, **variants)
        merged = np.ascontiguousarray(heads.transpose(0, 2, 1, 3)).reshape(B, Lq, H * D)
        out = project(merged, self.w_o, self.b_o).astype(result, copy=False)
        if unbatched:
            out = out[0]
        if not need_weights:
            return out
        weights = attention_weights(q, k, mask=mask, causal=causal, **variants)
        weights = np.asarray(weights).astype(result, copy=False)
        return out, (weights[0] if unbatched else weights)

    def _check_inputs(self, query, key, value):
        if query.ndim not in (2, 3):
            raise ValueError(
                f"query must have shape (batch, Lq, embed_dim) or (Lq, embed_dim), "
                f"got shape {query.shape}")
        for name, a, width, wname in (("query", query, self.embed_dim, "embed_dim"),
                                      ("key", key, self.kdim, "kdim"),
                                      ("value", value, self.vdim, "vdim")):
            if a.ndim != query.ndim:
                raise ValueError(
                    f"query, key and value must have the same number of dimensions, "
                    f"got query {query.shape}, key {key.shape} and value {value.shape}")
            if a.shape[-1] != width:
                raise ValueError(
                    f"the last axis of {name} {a.shape} must be {wname} = {width}")
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(
                f"key and value must have the same number of keys (axis -2), got "
                f"key {key.shape} and value {value.shape}")
        if query.ndim == 3 and not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ValueError(
                f"query, key and value must have the same batch size (axis 0), got "
                f"query {query.shape}, key {key.shape} and value {value.shape}")

    # ----------------------------------------------------------------- state dicts

    def state_dict(self):
        """The weights under PyTorch ``nn.MultiheadAttention``'s keys and layout.

        Returns
        -------
        state : dict of str to ndarray
            ``in_proj_weight`` ``(3 E, E)`` when ``kdim == vdim == embed_dim``, else
            ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``; then
            ``out_proj.weight``; and with biases ``in_proj_bias`` ``(3 E,)`` and
            ``out_proj.bias``. Copies: changing them does not change the layer.
        """
        state = {}
        if self.kdim == self.embed_dim and self.vdim == self.embed_dim:
            state["in_proj_weight"] = np.concatenate([self.w_q, self.w_k, self.w_v])
        else:
            state["q_proj_weight"] = self.w_q.copy()
            state["k_proj_weight"] = self.w_k.copy()
            state["v_proj_weight"] = self.w_v.copy()
        if self.bias:
            state["in_proj_bias"] = np.concatenate([self.b_q, self.b_k, self.b_v])
        state["out_proj.weight"] = self.w_o.copy()
        if self.bias:
            state["out_proj.bias"] = self.b_o.copy()
        return state

    @classmethod
    def from_state_dict(cls, state, num_heads, *, dtype=None):
        """Build a layer from PyTorch ``nn.MultiheadAttention`` weights.

        Parameters
        ----------
        state : mapping of str to array_like
            ``module.state_dict()`` with its values as NumPy arrays (anything
            ``numpy.asarray`` takes, e.g. ``{k: t.numpy() for k, t in ...}``):
            ``in_proj_weight`` ``(3 E, E)``, or ``q_proj_weight`` ``(E, E)``,
            ``k_proj_weight`` ``(E, kdim)`` and ``v_proj_weight`` ``(E, vdim)``;
            ``out_proj.weight`` ``(E, E)``; and, unless the module was built with
            ``bias=False``, ``in_proj_bias`` ``(3 E,)`` and ``out_proj.bias``
            ``(E,)``.
        num_heads : int
            The module's ``num_heads`` (the weights do not record it).
        dtype : float dtype, optional
            Dtype of the layer's weights; ``None`` keeps the arrays' (promoted) dtype.

        Returns
        -------
        MultiHeadAttention
            Called on the same input (``batch_first=True`` layout), it returns what
            the PyTorch module returns, up to rounding; see the class Notes for the
            mask convention.

        Raises
        ------
        ValueError
            Missing, unexpected or unsupported keys (``bias_k``/``bias_v`` of
            ``add_bias_kv``), or arrays whose shapes do not fit together.
        TypeError
            ``state`` not a mapping, or arrays that are not real numbers.

        Examples
        --------
        >>> import numpy as np
        >>> from fastattn import MultiHeadAttention
        >>> rng = np.random.default_rng(0)
        >>> state = {"in_proj_weight": rng.standard_normal((12, 4)),
        ...          "in_proj_bias": np.zeros(12),
        ...          "out_proj.weight": np.eye(4), "out_proj.bias": np.zeros(4)}
        >>> mha = MultiHeadAttention.from_state_dict(state, num_heads=2)
        >>> mha
        MultiHeadAttention(embed_dim=4, num_heads=2, dtype=float64)
        >>> mha(rng.standard_normal((1, 3, 4))).shape
        (1, 3, 4)
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of names to arrays, got "
                            f"{type(state).__name__}")
        keys = set(state)
        unsupported = keys & {"bias_k", "bias_v"}
        if unsupported:
            raise ValueError(
                f"state has {sorted(unsupported)}: modules built with add_bias_kv=True "
                f"are not supported")
        if "in_proj_weight" in keys:
            weight_keys = _PACKED
        else:
            weight_keys = _SEPARATE
        needed = set(weight_keys) | {"out_proj.weight"}
        has_bias = bool(keys & set(_BIASES))
        if has_bias:
            needed |= set(_BIASES)
        missing = sorted(needed - keys)
        if missing:
            raise ValueError(
                f"state is missing {missing} (it has {sorted(keys)}); expected "
                f"nn.MultiheadAttention's keys: in_proj_weight, or q_proj_weight, "
                f"k_proj_weight and v_proj_weight; out_proj.weight; and both "
                f"in_proj_bias and out_proj.bias, or neither")
        unexpected = sorted(keys - needed)
        if unexpected:
            raise ValueError(f"state has unexpected keys {unexpected}; expected "
                             f"{sorted(needed)}")
        arrays = {name: _v.as_real(state[name], f"state[{name!r}]") for name in needed}
        if dtype is None:
            dtype = _v.result_dtype(*arrays.values())
        dtype = _check_float_dtype(dtype)

        def shape_of(name, ndim):
            a = arrays[name]
            if a.ndim != ndim:
                raise ValueError(f"state[{name!r}] must have {ndim} dimension(s), got "
                                 f"shape {a.shape}")
            return a.shape

        E = shape_of("out_proj.weight", 2)[0]
        expect = {"out_proj.weight": (E, E)}
        if weight_keys == _PACKED:
            kdim = vdim = E
            expect["in_proj_weight"] = (3 * E, E)
        else:
            kdim = shape_of("k_proj_weight", 2)[1]
            vdim = shape_of("v_proj_weight", 2)[1]
            expect.update(q_proj_weight=(E, E), k_proj_weight=(E, kdim),
                          v_proj_weight=(E, vdim))
        if has_bias:
            expect.update({"in_proj_bias": (3 * E,), "out_proj.bias": (E,)})
        for name, want in expect.items():
            if arrays[name].shape != want:
                raise ValueError(
                    f"state[{name!r}] has shape {arrays[name].shape}, expected {want} "
                    f"(embed_dim = {E} from out_proj.weight, kdim = {kdim}, "
                    f"vdim = {vdim})")

        self = cls.__new__(cls)
        self._set_sizes(E, num_heads, kdim, vdim)

        def take(a):
            return np.array(a, dtype=dtype, copy=True)

        if weight_keys == _PACKED:
            w = arrays["in_proj_weight"]
            self.w_q, self.w_k, self.w_v = take(w[:E]), take(w[E:2 * E]), take(w[2 * E:])
        else:
            self.w_q, self.w_k, self.w_v = (take(arrays[n]) for n in _SEPARATE)
        self.w_o = take(arrays["out_proj.weight"])
        if has_bias:
            b = arrays["in_proj_bias"]
            self.b_q, self.b_k, self.b_v = take(b[:E]), take(b[E:2 * E]), take(b[2 * E:])
            self.b_o = take(arrays["out_proj.bias"])
        else:
            self.b_q = self.b_k = self.b_v = self.b_o = None
        return self

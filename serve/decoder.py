"""A Llama-style decoder run over batch rows that share a cached prompt prefix (cascade attention).

Every discovery prompt starts with the same long prefix (chat template, system turn, the catalog: ~1,300 tokens)
and differs in a short tail (the query, then the answer). Hugging Face's key/value cache holds one copy of the
prefix per row, and every decoding step copies and re-reads all of them: at batch 16 that was two thirds of the
time. Here the prefix's keys and values are computed once and stored once; each row keeps only its own tail, in a
cache preallocated per slot (rows join and leave without moving the others). Attention scores against the shared
prefix and against the row's tail are joined and normalised by one softmax, which is exactly attention over their
concatenation, without copying the prefix's keys or values for each row.

A row's result does not depend on what shares its pass: its scores are laid out as alone (its share of the prefix,
then its tail; keys beyond its own tail, where another row's is longer, masked out), and every product and reduction
over them only adds the masked keys' exact zeros. Where the projections also give each row the same result whatever
the number of rows (bfloat16 on a CPU with bfloat16 units, as served there; not MKL's float32 products, which take
other kernels for a few rows), the same request gets the same answer, bit for bit, alone or in a batch of any others
(``tests/test_serve_decoder.py``).

A pass may also feed, after a row's tokens, speculative runs (the engine's guesses at what it will feed next): each
run sees the row and itself, not the other runs (tree attention), and the row keeps the one it ``adopt``s.

A small model's pass over a few dozen tokens on a CPU is mostly per-operation overhead, so a layer is written in few
operations: q, k and v as one projection, gate and up as another, queries and keys rotated together as complex
numbers (their projection's rows stored in pairs, ``_paired``), the norms' weights folded into the projections after
them, attention in float32 (small products, faster than bfloat16's on a CPU); and in bfloat16 the projections'
weights are prepacked for oneDNN.

The weights are the Hugging Face model's own (embeddings, norms, projections, MLPs, rotary embedding), so
the results match ``model(...)`` up to float rounding (``tests/test_serve_decoder.py`` checks it). Supported:
Llama-family decoders (Llama, SmolLM, Mistral, Qwen2: q/k/v/o projections, RMSNorm, rotary embeddings, no
sliding window).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, cast

import torch
import torch.nn.functional as F

from tooltrie.errors import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# A LoRA adapter as the decoder adds it: {linear layer: (A, scale * B)} (``serve.adapter.low_rank_updates``).
LowRankUpdates = Mapping[Any, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Prefix:
    """A prompt prefix's keys and values, one copy for all rows: per layer ``[kv_heads, length, head_dim]``, in
    float32 (attention's own precision here, ``SharedPrefixDecoder._attend``)."""

    ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.ids)


# A prefix, the positions of its rows in a pass, and which of its keys each of them does not see (None: all seen).
PrefixGroup = tuple[Prefix, torch.Tensor, torch.Tensor | None]


class SharedPrefixDecoder:
    """Runs ``model``'s decoder for up to ``slots`` rows at once, each row a prefix (shared) plus its own tail."""

    def __init__(self, model: Any, slots: int, *, capacity: int = 64,
                 adapter: LowRankUpdates | None = None) -> None:
        """``adapter``: a LoRA adapter's updates of the model's linear layers (``serve.adapter.low_rank_updates``),
        added to their outputs in each pass: the model's weights stay as they are, shared with every other decoder
        on it."""
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "sliding_window", None):
            raise ModelError(f"the engine runs Llama-style decoders ({', '.join(SUPPORTED_MODEL_TYPES)}, no "
                             f"sliding window); this model is {model_type!r}")
        decoder = model.get_decoder()
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.blocks = _blocks(decoder) if not adapter else [block.adapted(adapter) for block in _blocks(decoder)]
        attention = decoder.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = attention.scaling
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.slots = slots
        self._tail_keys: list[torch.Tensor] = []
        self._tail_values: list[torch.Tensor] = []
        self._allocate(capacity)
        self.tail_length = torch.zeros(slots, dtype=torch.long, device=self.device)  # tokens in each slot's tail
        self._prefix: list[Prefix | None] = [None] * slots
        self._prefix_used = torch.zeros(slots, dtype=torch.long, device=self.device)  # of the prefix, per slot
        self._runs: list[list[tuple[int, int]]] = [[] for _ in range(slots)]  # last pass's runs: (place, length)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the tail caches with room for ``capacity`` tokens per slot, keeping what they hold."""
        shape = (self.kv_heads, self.slots, capacity, self.head_dim)  # key-value heads first, as attention reads
        old = len(self._tail_keys) > 0
        for store in (self._tail_keys, self._tail_values):
            for i in range(len(self.blocks)):
                fresh = torch.zeros(shape, dtype=torch.float32, device=self.device)  # attention's precision
                if old:
                    fresh[:, :, : store[i].shape[2]] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.capacity = capacity

    # -- rows -----------------------------------------------------------------------------------------------------

    def prefix(self, ids: list[int]) -> Prefix:
        """Compute a prefix's keys and values (one causal forward pass over it, no slot needed)."""
        keys, values = [], []
        hidden = self.embed(torch.tensor(ids, device=self.device))
        turns = self._turns(hidden, torch.arange(len(ids), device=self.device))
        for block in self.blocks:
            q, k, v = (x.transpose(0, 1) for x in self._project(block, hidden, turns))  # [heads, P, d]
            keys.append(k.contiguous())
            values.append(v.contiguous())
            out = F.scaled_dot_product_attention(q, keys[-1], values[-1], is_causal=True, scale=self.scaling,
                                                 enable_gqa=self.groups > 1)  # [H, P, d]
            hidden = self._finish_block(block, hidden, out.transpose(0, 1).reshape(len(ids), -1).to(self.dtype))
        return Prefix(ids=tuple(ids), keys=keys, values=values)

    def start(self, slot: int, prefix: Prefix, used: int) -> None:
        """Begin a row in ``slot`` on the first ``used`` tokens of ``prefix`` (its prompt may part from the prefix
        before the prefix ends: a query can merge with the prefix's last token)."""
        self._prefix[slot] = prefix
        self._prefix_used[slot] = used
        self.tail_length[slot] = 0
        self._runs[slot] = []

    def release(self, slot: int) -> None:
        self._prefix[slot] = None

    # -- the forward pass ------------------------------------------------------------------------------------------

    def forward(self, slots: list[int], feeds: list[list[int]],
                runs: Sequence[Sequence[Sequence[int]]] | None = None) -> torch.Tensor:
        """Feed each slot its new tokens (one or more each) in one pass; returns the last hidden state of each
        row ``[len(slots), hidden]`` (the input of the output layer at the row's last new token).

        ``runs[i]`` (speculation): token runs that each continue row i's feed, fed in the same pass. A run sees the
        row and itself, not the other runs, and stays out of the row unless ``adopt``-ed after the pass; the last
        hidden state of every run follows the rows' in the result (row by row, run by run).

        The tokens are packed (no padding) through the projections and MLPs, which cost the most; only attention
        lays them out per row, ``width`` = the longest feed with its runs."""
        runs = runs or [()] * len(slots)
        packed = [[*feed, *(t for run in row_runs for t in run)] for feed, row_runs in zip(feeds, runs, strict=True)]
        n, width = len(slots), max(len(tokens) for tokens in packed)
        kv, groups, d = self.kv_heads, self.groups, self.head_dim
        rows = torch.tensor(slots, device=self.device)
        lengths = [len(tokens) for tokens in packed]
        firsts = [0, *accumulate(lengths)][:-1]  # each row's first packed token (on the host: no device round trip)
        new = torch.tensor(lengths, device=self.device)
        row_of = torch.repeat_interleave(torch.arange(n, device=self.device), new)  # each packed token's row
        offset_of = (torch.arange(sum(lengths), device=self.device)
                     - torch.tensor(firsts, device=self.device)[row_of])  # its place in the feed
        start = self.tail_length[rows]  # where each feed goes in its row's tail
        layout = _Layout(feeds, runs, width)
        if int((start + width).max()) > self.capacity:
            self._allocate(max(2 * self.capacity, int((start + width).max())))
        prefix_used = self._prefix_used[rows]
        groups_of_rows = self._prefix_groups(slots, prefix_used)
        tail_width = int((start + new).max())
        place = start[row_of] + offset_of  # each token's place in its row's tail
        slot_of = rows[row_of]
        # A token sees its row's share of the prefix, the row's tail from before this pass, and its own ancestors
        # among the new tokens (the feed before it; in a run, also the run before it).
        before = torch.arange(tail_width, device=self.device) - start[:, None]  # [n, S]: < 0 for the old tail
        ancestors = layout.ancestors(self.device).gather(
            2, before.clamp(0, width - 1)[:, None].expand(-1, width, -1))
        sees_tail = (before < 0)[:, None] | ((before < width)[:, None] & ancestors)  # [n, w, S]
        masks = [_attention_mask(prefix, hidden_keys, sees_tail[members], groups, self.device)
                 for prefix, members, hidden_keys in groups_of_rows]
        # Feeds of one length (a lone row, or a step of single tokens) are already laid out by row: no scatter.
        padded = all(len(tokens) == width for tokens in packed)
        # Consecutive slots (always so for a lone row) are read from the tail caches as views, not gathered.
        consecutive = slice(slots[0], slots[0] + n) if slots == list(range(slots[0], slots[0] + n)) else None
        # A lone row's new keys and values go to one stretch of its tail: a copy, not a scatter.
        stretch = slice(int(start[0]), int(start[0]) + width) if n == 1 else None

        hidden = self.embed(torch.tensor([t for tokens in packed for t in tokens], device=self.device))  # [T, hidden]
        depth = torch.tensor(layout.depths, device=self.device)  # a run's tokens follow the feed, not each other
        turns = self._turns(hidden, prefix_used[row_of] + start[row_of] + depth)
        for i, block in enumerate(self.blocks):
            q, k, v = self._project(block, hidden, turns)  # q [T, H, d]; k, v [T, KV, d]
            if stretch is not None:
                self._tail_keys[i][:, slots[0], stretch] = k.transpose(0, 1)
                self._tail_values[i][:, slots[0], stretch] = v.transpose(0, 1)
            else:
                self._tail_keys[i][:, slot_of, place] = k.transpose(0, 1)
                self._tail_values[i][:, slot_of, place] = v.transpose(0, 1)
            if padded:
                by_row = q.view(n, width, kv * groups, d)
            else:
                by_row = q.new_zeros(n, width, kv * groups, d)
                by_row[row_of, offset_of] = q
            cached = (self._tail_keys[i], self._tail_values[i])
            tail_k, tail_v = (c[:, consecutive, :tail_width] if consecutive else c[:, rows, :tail_width]
                              for c in cached)
            out = self._attend(by_row, groups_of_rows, masks, i, tail_k, tail_v)
            out = (out.reshape(n * width, -1) if padded else out[row_of, offset_of].reshape(len(row_of), -1)).to(
                self.dtype)
            hidden = self._finish_block(block, hidden, out)
        fed = torch.tensor([len(feed) for feed in feeds], device=self.device)
        self.tail_length[rows] = start + fed  # the runs' keys and values lie beyond, until adopted or overwritten
        for slot, row_start, places in zip(slots, start.tolist(), layout.run_places, strict=True):
            self._runs[slot] = [(row_start + offset, length) for offset, length in places]
        last = [first + len(feed) - 1 for first, feed in zip(firsts, feeds, strict=True)]
        last += [first + offset + length - 1 for first, places in zip(firsts, layout.run_places, strict=True)
                 for offset, length in places]
        return self.norm(hidden[torch.tensor(last, device=self.device)])  # type: ignore[no-any-return]

    def adopt(self, slot: int, run: int) -> None:
        """Make run ``run`` of ``slot``'s last pass part of the row, as if it had been fed after the feed: its keys
        and values move up to follow the row's tail (the first run already does)."""
        place, length = self._runs[slot][run]
        end = int(self.tail_length[slot])
        if place != end:
            for store in (*self._tail_keys, *self._tail_values):
                store[:, slot, end : end + length] = store[:, slot, place : place + length].clone()
        self.tail_length[slot] = end + length
        self._runs[slot] = []

    def _attend(self, by_row: torch.Tensor, groups_of_rows: list[PrefixGroup], masks: list[torch.Tensor],
                layer: int, tail_k: torch.Tensor, tail_v: torch.Tensor) -> torch.Tensor:
        """Attention of the queries ``by_row`` [n, w, H, d] over each row's prefix and tail (``tail_k``, ``tail_v``
        [KV, n, S, d]); returns [n, w, H, d] in float32. Attention runs in float32 whatever the model's dtype: its
        products are small (a few query rows against some dozens of keys), take a third of bfloat16's time on a
        CPU, and are more exact."""
        n, width, _, d = by_row.shape
        kv, groups = self.kv_heads, self.groups
        q = by_row.view(n, width, kv, groups, d).permute(2, 0, 3, 1, 4).reshape(kv, n, groups * width, d)
        if len(groups_of_rows) == 1:  # every row on one prefix: no split
            out = self._attend_group(q, groups_of_rows[0][0], masks[0], layer, tail_k, tail_v)
        else:
            out = torch.empty_like(q)
            for (prefix, members, _), mask in zip(groups_of_rows, masks, strict=True):
                out[:, members] = self._attend_group(q[:, members], prefix, mask, layer, tail_k[:, members],
                                                     tail_v[:, members])
        return out.view(kv, n, groups, width, d).permute(1, 3, 0, 2, 4).reshape(n, width, kv * groups, d)

    def _attend_group(self, q: torch.Tensor, prefix: Prefix, mask: torch.Tensor, layer: int, tail_keys: torch.Tensor,
                      tail_values: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` [KV, m, M, d] over one shared prefix and each row's tail (``tail_keys``,
        ``tail_values`` [KV, m, S, d]): the prefix's scores beside the tail's, one softmax over both under ``mask``
        (additive, [m, M, P + S]), the two value products summed. Every row's queries meet the prefix's keys and
        values in one product per key-value head: they are read once, never copied per row."""
        kv, m, rows_per, d = q.shape
        length = len(prefix)
        on_prefix = torch.matmul(q.reshape(kv, m * rows_per, d), prefix.keys[layer].transpose(-1, -2))
        on_tail = torch.matmul(q, tail_keys.transpose(-1, -2))  # [KV, m, M, S]
        scores = torch.cat((on_prefix.view(kv, m, rows_per, length), on_tail), dim=-1)
        weights = scores.mul_(self.scaling).add_(mask).softmax(-1)  # [KV, m, M, P + S]
        out = torch.matmul(weights[..., length:], tail_values)
        from_prefix = torch.matmul(weights[..., :length].reshape(kv, m * rows_per, length), prefix.values[layer])
        return out.add_(from_prefix.view(kv, m, rows_per, d))

    def _prefix_groups(self, slots: list[int], used: torch.Tensor) -> list[PrefixGroup]:
        """The prefixes the rows use, each with the positions (in ``slots``) of its rows and which of its keys
        each of them does not see (None when every row sees all of it: the usual case)."""
        members: dict[int, tuple[Prefix, list[int]]] = {}
        for position, slot in enumerate(slots):
            prefix = self._prefix[slot]
            if prefix is None:
                raise ValueError(f"slot {slot} was not started")
            members.setdefault(id(prefix), (prefix, []))[1].append(position)
        groups = []
        for prefix, positions in members.values():
            rows = torch.tensor(positions, device=self.device)
            short = used[rows] < len(prefix)
            hidden_keys = (torch.arange(len(prefix), device=self.device) >= used[rows][:, None]
                           if bool(short.any()) else None)  # [m, P]
            groups.append((prefix, rows, hidden_keys))
        return groups

    def _turns(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotary embedding's turn at each position [T, d/2], as unit complex numbers (float32)."""
        cos, sin = self.rotary(hidden[None], positions[None])
        half = self.head_dim // 2  # Llama's cos and sin repeat their first half
        return torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())

    def _project(self, block: _Block, hidden: torch.Tensor,
                 turns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, d], keys and values [T, KV, d] of packed tokens, rotary positions applied, in float32
        (attention's precision, ``_attend``)."""
        x = _rms_normalized(hidden, block.eps)  # the norm's weight is in qkv's
        qkv = block.qkv(x).view(x.shape[0], -1, self.head_dim)
        heads = self.heads
        qk = _rotate(qkv[:, : heads + self.kv_heads], turns)  # queries and keys turned together
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + self.kv_heads :].float()

    @staticmethod
    def _finish_block(block: _Block, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and residual, then the MLP with its residual (packed tokens [T, ...])."""
        hidden = hidden + block.o(attended)
        gate, up = block.gate_up(_rms_normalized(hidden, block.eps)).chunk(2, dim=-1)
        return hidden + block.down(block.act(gate) * up)


def _attention_mask(prefix: Prefix, hidden_keys: torch.Tensor | None, sees_tail: torch.Tensor, groups: int,
                    device: torch.device) -> torch.Tensor:
    """The additive mask (0 where a query sees the key, -inf where not) of one prefix's rows [m, G*w, P + S]: each
    row's share of the prefix (``hidden_keys`` [m, P], True where a row does not see a key; None: every row sees all
    of it), then what each of its ``w`` query places sees of its tail (``sees_tail`` [m, w, S]), the same for the
    ``groups`` query heads of a key-value head."""
    m, width, tail_width = sees_tail.shape
    sees_prefix = (torch.ones(m, len(prefix), dtype=torch.bool, device=device) if hidden_keys is None
                   else ~hidden_keys)
    sees = torch.cat((sees_prefix[:, None].expand(-1, width, -1), sees_tail), dim=-1)  # [m, w, P + S]
    sees = sees[:, None].expand(-1, groups, -1, -1).reshape(m, groups * width, len(prefix) + tail_width)
    return torch.zeros(sees.shape, dtype=torch.float32, device=device).masked_fill_(~sees, float("-inf"))


class _Layout:
    """How a pass's new tokens sit in each row: the feed, then each of its runs; every token's depth (its position
    after the row's old tail: a run continues the feed) and which of the row's new tokens it sees."""

    def __init__(self, feeds: Sequence[Sequence[int]], runs: Sequence[Sequence[Sequence[int]]], width: int) -> None:
        self.feeds, self.width = feeds, width
        self.depths: list[int] = []
        self.run_places: list[list[tuple[int, int]]] = []  # per row: (offset in the packed row, length) of each run
        for feed, row_runs in zip(feeds, runs, strict=True):
            self.depths += range(len(feed))
            places, offset = [], len(feed)
            for run in row_runs:
                self.depths += range(len(feed), len(feed) + len(run))
                places.append((offset, len(run)))
                offset += len(run)
            self.run_places.append(places)

    def ancestors(self, device: torch.device) -> torch.Tensor:
        """[n, w, w]: new token j of a row sees new token i (causal, except that a run skips the runs before it)."""
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=device).tril()
        if not any(self.run_places):
            return causal.expand(len(self.feeds), -1, -1)
        sees = causal.repeat(len(self.feeds), 1, 1)
        for row, (feed, places) in enumerate(zip(self.feeds, self.run_places, strict=True)):
            for offset, length in places:
                sees[row, offset : offset + length, len(feed) : offset] = False
        return sees


_Reorder = Callable[[torch.Tensor], torch.Tensor]


class _Linear:
    """``x @ W.T + b``, ``W`` (and ``b``) the stacked weights of one or more of the model's linear layers.

    In bfloat16 on a CPU the weight is held prepacked in oneDNN's layout instead (the op torch's own compiler emits
    for frozen CPU graphs): the same products, bit for bit, and faster at a pass's few rows (here, gate/up at 35
    rows with its weight out of cache: 386 us against 555 for ``F.linear``; an ``ask`` answer 3-14 % faster).
    Elsewhere, or where this torch lacks the op, ``F.linear``.
    """

    def __init__(self, layers: Sequence[Any], reorders: Sequence[_Reorder | None] = (),
                 input_scale: torch.Tensor | None = None) -> None:
        """``reorders[i]``, if given, reorders the output rows (weight and bias) of ``layers[i]``; ``input_scale``
        (a norm's weight) multiplies the inputs, folded into the weight's columns."""
        reorders = list(reorders) or [None] * len(layers)

        def rows(tensor: torch.Tensor, reorder: _Reorder | None) -> torch.Tensor:
            return tensor if reorder is None else reorder(tensor)

        weights = [rows(layer.weight.detach(), reorder) for layer, reorder in zip(layers, reorders, strict=True)]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        if input_scale is not None:
            weight = (weight.float() * input_scale.float()).to(weight.dtype)
        self.bias = None if all(layer.bias is None for layer in layers) else torch.cat(
            [layer.weight.new_zeros(layer.out_features) if layer.bias is None else rows(layer.bias.detach(), reorder)
             for layer, reorder in zip(layers, reorders, strict=True)])
        self.packed = _prepacked(weight)
        self.weight = weight if self.packed is None else None
        self.layers, self.reorders, self.input_scale = list(layers), reorders, input_scale
        self.low_rank: tuple[torch.Tensor, torch.Tensor] | None = None  # (A, B): x @ A.T @ B.T is added

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            out = F.linear(x, self.weight, self.bias)
        else:
            out = cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none",
                                                                       [], ""))
        if self.low_rank is not None:
            a, b = self.low_rank
            out = out + F.linear(F.linear(x, a), b)
        return out

    def adapted(self, updates: LowRankUpdates) -> _Linear:
        """This projection plus the updates of its layers (itself when none has one), sharing its weight. Stacked
        layers' updates stack too: their A's side by side, their B's block-diagonal, with the rows reordered and the
        input scaled as the weight's are."""
        found = [updates.get(layer) for layer in self.layers]
        if not any(found):
            return self
        ranks = [0 if update is None else update[0].shape[0] for update in found]
        a_stack = torch.zeros(sum(ranks), self.layers[0].in_features)
        b_stack = torch.zeros(sum(layer.out_features for layer in self.layers), sum(ranks))
        row = column = 0
        for layer, update, rank, reorder in zip(self.layers, found, ranks, self.reorders, strict=True):
            if update is not None:
                a, b = update
                a_stack[column : column + rank] = a.cpu()
                b_stack[row : row + layer.out_features, column : column + rank] = (
                    b.cpu() if reorder is None else reorder(b.cpu()))
            row, column = row + layer.out_features, column + rank
        if self.input_scale is not None:
            a_stack = a_stack * self.input_scale.float().cpu()
        weight = self.layers[0].weight
        adapted = copy.copy(self)
        adapted.low_rank = (a_stack.to(weight.device, weight.dtype), b_stack.to(weight.device, weight.dtype))
        return adapted


def _prepacked(weight: torch.Tensor) -> torch.Tensor | None:
    usable = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not usable:
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_ROWS)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):  # an op this torch build does not have
        return None


_PACKED_FOR_ROWS = 32  # the row count oneDNN's layout is chosen for: a prompt's tail, or a batch of rows


class _Block:
    """One decoder layer's weights as the pass uses them: the model's own tensors, with q, k and v stacked into one
    projection and gate and up into another (one matrix product each, not three and two), the norms' weights folded
    into them (the norms run unweighted, ``_rms_normalized``). Stacked or prepacked weights are copies: in bfloat16
    a copy of every linear weight (~200 MB for SmolLM2-135M), in float32 of q/k/v and gate/up (~280 MB); one per
    model, shared by every decoder on it (``_blocks``)."""

    def __init__(self, layer: Any) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        paired = partial(_paired, head_dim=attention.head_dim)  # queries and keys, for the rotary embedding
        # Each norm's weight scales the columns of the projection after it: the norm itself is left unweighted.
        self.qkv = _Linear([attention.q_proj, attention.k_proj, attention.v_proj], [paired, paired, None],
                           input_scale=layer.input_layernorm.weight.detach())
        self.o = _Linear([attention.o_proj])
        self.gate_up = _Linear([mlp.gate_proj, mlp.up_proj], input_scale=layer.post_attention_layernorm.weight.detach())
        self.down = _Linear([mlp.down_proj])
        self.act = mlp.act_fn
        self.eps = layer.input_layernorm.variance_epsilon
        self.source = _identity(layer)

    def adapted(self, updates: LowRankUpdates) -> _Block:
        """This block with a LoRA adapter's updates added to its projections; the weights stay shared."""
        adapted = copy.copy(self)
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(adapted, name, getattr(self, name).adapted(updates))
        return adapted


def _identity(layer: Any) -> tuple[tuple[int, int], ...]:
    """Where a layer's weights live and how often they were changed in place: a change means new blocks."""
    return tuple((p.data_ptr(), p._version) for p in layer.parameters())


_BLOCKS: weakref.WeakKeyDictionary[Any, list[_Block]] = weakref.WeakKeyDictionary()


def _blocks(decoder: Any) -> list[_Block]:
    """The blocks of ``decoder``'s layers, built once per model and shared (engines for several registries run on
    one model); rebuilt if its weights were replaced or changed in place since."""
    blocks = _BLOCKS.get(decoder)
    if blocks is None or any(block.source != _identity(layer) for block, layer in zip(blocks, decoder.layers,
                                                                                     strict=True)):
        with torch.no_grad():
            blocks = _BLOCKS[decoder] = [_Block(layer) for layer in decoder.layers]
    return blocks


def release_copied_weights(model: Any) -> int:
    """Let go of the model's linear weights that the decoder holds copies of (in bfloat16 on a CPU every one,
    prepacked: ~200 MB for SmolLM2-135M; in float32 q/k/v and gate/up, stacked), for a process that answers only
    through engines (``tooltrie ask``, ``tooltrie serve``): the model is then held once. Each becomes a stand-in of
    its shape, dtype and device holding one element (what an adapter's updates are checked and placed against), and
    the model's own forward refuses to run. Returns the bytes let go."""
    decoder = model.get_decoder()
    blocks = _blocks(decoder)
    freed = 0
    with torch.no_grad():
        for block, layer in zip(blocks, decoder.layers, strict=True):
            for linear in (block.qkv, block.o, block.gate_up, block.down):
                for module in linear.layers:
                    weight = module.weight
                    storage = weight.untyped_storage()
                    shared = linear.weight is not None and linear.weight.untyped_storage().data_ptr() == \
                        storage.data_ptr()
                    if shared or storage.nbytes() <= weight.element_size():
                        continue  # a stand-in already, or the very tensor the decoder multiplies by
                    freed += weight.numel() * weight.element_size()
                    stand_in = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
                    module.weight = torch.nn.Parameter(stand_in, requires_grad=False)
            block.source = _identity(layer)  # the blocks stay this layer's
    if freed and not getattr(model, "_tooltrie_engine_only", False):
        model.register_forward_pre_hook(_refuse_forward)
        model._tooltrie_engine_only = True
    _give_back_freed_memory()
    return freed


def _give_back_freed_memory() -> None:
    """glibc keeps freed heap blocks for later allocations, still resident (the weights let go were 0.2 GB of them);
    ``malloc_trim`` hands their pages back to the system. Elsewhere (another C library): nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _refuse_forward(module: Any, args: Any) -> None:
    raise ModelError("this model's projection weights were handed to its engines (release_copied_weights): it "
                     "answers through an Engine only; load it again to run its own forward")


def _rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` per row (RMSNorm without its weight): the rows' norms in float32 in one reduction,
    then one product, where ``F.rms_norm`` makes four full passes (to float32, square, scale, back)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return x * torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps)).to(x.dtype)


def _rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [T, heads, d] whose head dimensions are stored in pairs (``_paired``):
    each pair, a complex number, times its position's turn (``turns`` [T, d/2]); in float32, as it returns."""
    pairs = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * turns[:, None]).flatten(-2)


def _paired(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A query or key projection's output rows reordered within each head so that the dimensions Llama's rotary
    embedding turns together (i and i + d/2) sit side by side. Queries and keys reordered alike have the same dot
    products: attention is unchanged, the rotation is one complex product."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()  # 0, d/2, 1, d/2+1, ..
    order = (torch.arange(weight.shape[0] // head_dim)[:, None] * head_dim + within).flatten()
    return weight[order.to(weight.device)]

"""The prefix index: which token sequences still have their KV in the pool, as a radix tree
(a token trie whose edges hold runs of tokens), so a new request can read its longest
cached prefix instead of computing it again.

How it maps onto llama.cpp's unified KV cache, where a cell can belong to several sequence
ids at once (`seq_cp` tags cells with one more id, no copy): every leaf has a *holder*, a
sequence id whose cells are exactly the tokens from the root to the end of that leaf. A
node's cells are therefore tagged by the holders of all leaves below it, and any of them
can lend the node's prefix to a new request (`Share`). Holders live on leaves only: when a
leaf gets a child, its old holder is redundant and released; when the last child of a node
is evicted, that child's holder trims its own span and becomes the node's holder.

Pure bookkeeping: every change the engine must make to its cache is returned as data
(`Share`, `Trim`, `Release`), in order, for the caller to put in the next step's batch.
Cells are counted once, under the tree (`cells`); a node read by a running request
(`refs` > 0, from `acquire` until `release`) is never evicted.

Sliding-window attention (`window` > 0, e.g. Gemma 3): llama.cpp lets a new token's cell
overwrite a cell that has one owner and lies a window or more behind that owner's last
position, so a holder keeps only its last `window` positions intact on those layers. A
reader that continues from position L needs the window before L: a point is certainly
intact at the end of a leaf whose holder computed or read its last window itself
(`readable`), and where a *pin* — a sequence id tagging only the window before a node's
end — keeps those cells with two owners. A running prompt offered to the cache (`publish`)
ends such a leaf; when the leaf gets a child (the request's output, or the next turn), its
holder stays as the pin of that point, so the next turn of a conversation reads at least
the previous turn's prompt even where the answer does not tokenize back the same. With a
window the index lends only these points, and never gives a finishing sequence another
holder's cells for its own last window (it then caches nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.step_types import KVOp, Release, Share, Trim


@dataclass(eq=False, slots=True)
class _Node:
    tokens: list[int]  # this edge's run of tokens
    start: int  # position of its first token
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    holder: int | None = None  # leaves only: the seq id holding root → its end
    refs: int = 0  # running requests reading through it
    last_used: int = 0
    readable: bool = True  # leaves: a read may end here (see the module docstring)
    pin: int | None = None  # with a window: the id keeping the window before its end

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class Lease:
    """What a request reads from the index: the first `length` positions, through `node`."""

    node: _Node | None
    length: int


class PrefixIndex:
    def __init__(self, window: int = 0) -> None:
        self.window = window  # the model's sliding attention window (0: none)
        self._root = _Node([], 0, None)
        self._tick = 0
        self.cells = 0  # cells held by the tree, each counted once
        self._locked = 0  # of which in nodes a running request reads (refs > 0)

    def reach(self, end: int) -> int:
        """The first position a token at `end` attends to on the window layers: the cells a
        read continuing at `end` needs are [reach(end), end). (The cell a full window back
        is not among them: llama.cpp may already have given it to another token.)"""
        return max(0, end - self.window + 1)

    # ---- reading ---------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> int:
        """The length of the longest cached prefix of `tokens`."""
        node, off = self._walk(tokens)
        return (node.start + off) if node is not self._root else 0

    def readable(self, tokens: Sequence[int], limit: int) -> int:
        """How much of `tokens` (at most `limit`) a new sequence can read: the longest
        cached prefix, or with a window the longest that ends where a read may end."""
        node, off = self._walk(tokens[:limit])
        if node is self._root or off == 0:
            return 0
        if not self.window:
            return node.start + off
        if off < len(node.tokens):  # ends inside an edge: its last intact point is above
            node = node.parent  # type: ignore[assignment]
        n: _Node | None = node
        while n is not None and n is not self._root:
            if n.pin is not None or (not n.children and n.readable):
                return n.end
            n = n.parent
        return 0

    def acquire(self, tokens: Sequence[int], seq: int, limit: int) -> tuple[Lease, list[KVOp]]:
        """Let `seq` (a fresh sequence) read the longest readable prefix of `tokens`, at
        most `limit` tokens (a request must still compute one token of its own, for
        logits). Its nodes cannot be evicted until `release`."""
        n = self.readable(tokens, limit)
        if n == 0:
            return Lease(None, 0), []
        lease = self._lock(tokens, n)
        assert lease.node is not None
        return lease, [Share(self._holder_below(lease.node), seq, 0, n)]

    def _lock(self, tokens: Sequence[int], length: int) -> Lease:
        node, off = self._walk(tokens[:length])
        assert node is not self._root and node.start + off == length
        if off < len(node.tokens):
            node = self._split(node, off)
        self._tick += 1
        n: _Node | None = node
        while n is not None and n is not self._root:
            self._locked += len(n.tokens) if n.refs == 0 else 0
            n.refs += 1
            n.last_used = self._tick
            n = n.parent
        return Lease(node, node.end)

    def release(self, lease: Lease) -> None:
        n = lease.node
        while n is not None and n is not self._root:
            n.refs -= 1
            self._locked -= len(n.tokens) if n.refs == 0 else 0
            n = n.parent

    # ---- writing ---------------------------------------------------------------------
    def insert(
        self, tokens: Sequence[int], seq: int, shared: int, keep: int | None = None
    ) -> tuple[int, list[KVOp]]:
        """A finished sequence offers its KV: `seq` holds `tokens` at positions 0.., the
        first `shared` of them read from the index (`acquire`). Returns the cells it
        gives up (already cached elsewhere) and the ops; what is new becomes a leaf held
        by `seq`, the rest of `seq` is released or trimmed. With a window, cells it takes
        from the tree instead of its own are intact from `keep` on too (see `keeps`)."""
        node, off = self._walk(tokens)
        k = node.start + off if node is not self._root else 0
        self._tick += 1
        if k == len(tokens):  # nothing new: every cell it holds beyond `shared` is a copy
            self._touch(node)
            return len(tokens) - shared, [Release(seq)]
        ops: list[KVOp] = []
        if k > shared:  # it computed cached positions itself: it reads the tree's instead
            got = self._take_tree_cells(node, seq, shared, k, len(tokens), keep)
            if got is None:  # keep nothing rather than lend a broken prefix
                return len(tokens) - shared, [Release(seq)]
            ops += got
        return k - shared, ops + self._add_leaf(node, off, tokens, k, seq)

    def _take_tree_cells(
        self, node: _Node, seq: int, shared: int, k: int, end: int, keep: int | None = None
    ) -> list[KVOp] | None:
        """`seq` gives up its own cells for positions [shared, k), which the tree holds
        down to `node`, and tags the tree's instead; None when, with a window, no holder's
        cells there are certainly intact where a read at `end` needs them (after
        reach(end), or from `keep` on)."""
        need = max(shared, self.reach(end)) if self.window else k
        if keep is not None:
            need = min(need, max(shared, keep))
        src = self._holder_covering(node, need, k) if need < k else self._holder_below(node)
        if src is None:
            return None
        return [Trim(seq, shared, k), Share(src, seq, shared, k)]

    def _add_leaf(
        self, node: _Node, off: int, tokens: Sequence[int], k: int, seq: int
    ) -> list[KVOp]:
        """`tokens[k:]` becomes a leaf below the point (`node`, `off`) that `tokens[:k]`
        reaches, held by `seq`; a leaf that gets a child gives up its holder, which with a
        window stays as the pin of its end."""
        ops: list[KVOp] = []
        if node is not self._root and off < len(node.tokens):
            node = self._split(node, off)
        if node is not self._root and not node.children:  # a leaf gets a child
            assert node.holder is not None
            if self.window and node.readable and node.pin is None:  # its holder pins its end
                ops.append(Trim(node.holder, 0, self.reach(node.end)))
                node.pin = node.holder
            else:
                ops.append(Release(node.holder))
            node.holder = None
        leaf = _Node(list(tokens[k:]), k, node, holder=seq)
        node.children[tokens[k]] = leaf
        self.cells += len(leaf.tokens)
        self._touch(leaf)
        return ops

    def publish(
        self, tokens: Sequence[int], seq: int, lease: Lease, new_id: Callable[[], int]
    ) -> tuple[Lease, int, list[KVOp]] | None:
        """A running sequence `seq`, which read `lease`, has computed `tokens` (its prompt,
        or the part others wait for): a fresh holder (`new_id()`) tags the same cells and
        holds them as a new leaf, so requests arriving while `seq` goes on read them, and
        `seq`'s lease moves to that leaf. Where the tree already holds more of `tokens`
        than `seq` read (another request computed that stretch too, if only a BOS token),
        `seq` gives up its own copy for the tree's first (`_take_tree_cells`). Returns the
        new lease, the cells `seq` gave up and the ops; None (nothing changes) when the
        tree has nothing new from `seq`, or no intact copy of that stretch under a window."""
        n = len(tokens)
        node, off = self._walk(tokens)
        k = node.start + off if node is not self._root else 0
        if k == n:
            return None
        ops: list[KVOp] = []
        if k > lease.length:
            got = self._take_tree_cells(node, seq, lease.length, k, n)
            if got is None:
                return None
            ops += got
        holder = new_id()
        ops.append(Share(seq, holder, 0, n))
        self._tick += 1
        ops += self._add_leaf(node, off, tokens, k, holder)
        self.release(lease)
        return self._lock(tokens, n), k - lease.length, ops

    def keeps(self, tokens: Sequence[int], shared: int, pos: int) -> bool:
        """Would `insert(tokens, …, shared, keep=pos)` find the cells it takes from the tree
        intact from `pos` on? (True when it takes none there.)"""
        node, off = self._walk(tokens)
        k = node.start + off if node is not self._root else 0
        if k <= max(pos, shared) or k == len(tokens):
            return True
        need = max(shared, min(self.reach(len(tokens)), pos))
        return self._holder_covering(node, need, k) is not None

    def pin(self, tokens: Sequence[int], pin: int) -> bool:
        """With a window: make `pin` the pin of the end of `tokens` (a prompt whose
        sequence could not offer it while it ran, and has just been inserted; the caller
        tags the window before that end with it). False when that path is not cached,
        or its end is readable already: the caller releases the pin."""
        node, off = self._walk(tokens)
        if node is self._root or node.start + off != len(tokens):
            return False
        if off < len(node.tokens):
            node = self._split(node, off)
        if node.pin is not None or (not node.children and node.readable):
            return False
        node.pin = pin
        return True

    def unpin(self) -> list[KVOp]:
        """Release the pin of the least recently used node that has children (the
        shallowest first: in a conversation, its oldest turn); [] if there is none."""
        pinned = [n for n in self._nodes() if n.pin is not None and n.children]
        if not pinned:
            return []
        node = min(pinned, key=lambda n: (n.last_used, n.start))
        pin, node.pin = node.pin, None
        assert pin is not None
        return [Release(pin)]

    def evict(self, cells: int) -> tuple[int, list[KVOp]]:
        """Free at least `cells` cells (if that many are evictable), least recently used
        leaves first; returns the cells freed and the ops."""
        freed, ops = 0, []
        while freed < cells:
            leaf = min(self._free_leaves(), key=lambda n: n.last_used, default=None)
            if leaf is None:
                break
            freed += len(leaf.tokens)
            ops += self._drop_leaf(leaf)
        self.cells -= freed
        return freed, ops

    def unlocked(self, tokens: Sequence[int], n: int) -> int:
        """Of the first `n` positions of `tokens` (a cached prefix), how many lie in nodes no
        running request reads: cells that stop being evictable once a reader takes them."""
        node, _ = self._walk(tokens[:n])
        total = 0
        while node is not self._root:
            if node.refs == 0:
                total += min(node.end, n) - node.start
            node = node.parent  # type: ignore[assignment]
        return total

    @property
    def evictable(self) -> int:
        """Cells no running request reads: what eviction could free (asked every step)."""
        return self.cells - self._locked

    # ---- internals -------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int]) -> tuple[_Node, int]:
        """The deepest node `tokens` enters and how many of its tokens match (edges are
        compared as slices, in C: a prompt of 100K tokens is walked in microseconds)."""
        node, pos = self._root, 0
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return node, len(node.tokens)
            off = common_prefix(child.tokens, tokens[pos : pos + len(child.tokens)])
            if off < len(child.tokens):
                return child, off
            pos += off
            node = child
        return node, len(node.tokens)

    def _split(self, node: _Node, off: int) -> _Node:
        """Cut `node` after `off` tokens; returns the upper part (same cells, same refs)."""
        assert node.parent is not None and 0 < off < len(node.tokens)
        upper = _Node(node.tokens[:off], node.start, node.parent, refs=node.refs,
                      last_used=node.last_used)  # fmt: skip
        node.parent.children[node.tokens[0]] = upper
        node.tokens = node.tokens[off:]
        node.start += off
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _holder_below(self, node: _Node) -> int:
        while node.holder is None:
            node = next(iter(node.children.values()))
        return node.holder

    def _holder_covering(self, node: _Node, pos: int, end: int) -> int | None:
        """A holder below `node` whose window layers certainly still hold every position
        in [pos, end): each within its own last window (a leaf a trim made has none: its
        holder's end was further) or within the window a pin on its path keeps."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.children:
                continue
            spans = [(self.reach(n.end), n.end)] if n.readable else []
            up: _Node | None = n
            while up is not None and up is not self._root:
                if up.pin is not None:
                    spans.append((self.reach(up.end), up.end))
                up = up.parent
            at = pos
            for a, b in sorted(spans):
                if a <= at < b:
                    at = b
            if at >= end:
                return n.holder
        return None

    def _touch(self, node: _Node) -> None:
        n: _Node | None = node
        while n is not None:
            n.last_used = self._tick
            n = n.parent

    def _drop_leaf(self, leaf: _Node) -> list[KVOp]:
        parent, holder = leaf.parent, leaf.holder
        assert parent is not None and holder is not None
        del parent.children[leaf.tokens[0]]
        ops: list[KVOp] = [] if leaf.pin is None else [Release(leaf.pin)]
        if parent is self._root or parent.children:
            return [*ops, Release(holder)]  # the rest of its path is held by others
        parent.holder = holder  # the parent is a leaf now, held by what held its child
        parent.readable = not self.window  # whose window ended beyond it (a pin may keep it)
        return [*ops, Trim(holder, leaf.start, -1)]

    def _free_leaves(self) -> list[_Node]:
        return [n for n in self._nodes() if not n.children and n.refs == 0]

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def sanity_checks(self) -> None:
        nodes = self._nodes()
        assert self.cells == sum(len(n.tokens) for n in nodes), "cached cells drifted"
        assert self._locked == sum(len(n.tokens) for n in nodes if n.refs), "locked drifted"
        for n in nodes:
            assert n.tokens, "empty edge"
            assert (n.holder is not None) == (not n.children), "holders live on leaves"
            assert n.parent is not None and n.start == (
                n.parent.end if n.parent is not self._root else 0
            ), "positions do not continue"
            assert n.refs >= 0 and all(c.refs <= n.refs for c in n.children.values())
            assert n.pin is None or self.window, "pins only with a window"


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit` (slices
    compare in C: a binary search over them beats a Python loop over tokens)."""
    hi = min(len(a), len(b), len(a) if limit is None else limit)
    if hi <= 0 or a[0] != b[0]:
        return 0
    if a[:hi] == b[:hi]:
        return hi
    lo = 1  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo

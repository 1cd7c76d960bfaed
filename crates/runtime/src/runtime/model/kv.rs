//! The paged KV cache: keys and values live in fixed-size blocks of [`BLOCK_TOKENS`]
//! positions handed out by a [`KvPool`] with a hard capacity (as vLLM's PagedAttention
//! block manager). A sequence's [`KvCache`] is its block table: position `p` lives in block
//! `p / BLOCK_TOKENS` at slot `p % BLOCK_TOKENS`, so no sequence needs contiguous memory and
//! a finished sequence's blocks go straight back to the pool for the next one.
//!
//! **Prefix caching** (vLLM's automatic prefix caching): when the pool's prefix cache is on,
//! every full block is content-addressed — its key hashes its parent block's key, its
//! tokens, and how many of its positions were computed in prompt (prefill) order, the one
//! thing besides the tokens that changes the bits of a position's keys and values
//! ([`crate::runtime::model::llama::Llama::forward_stage`]). A new sequence adopts the longest chain of
//! cached blocks that starts its tokens ([`KvCache::adopt_prefix`]) and computes only the
//! rest; since those blocks hold exactly the bits its own prefill would have produced, the
//! output is the same bit for bit. Blocks nobody holds stay cached and are evicted least
//! recently used first (a chain's tail before its head) when the pool needs memory.
//!
//! Every rank of a replica has a pool of the same capacity and sees the same sequence of
//! allocations (the driver's steps), so the driver's pool speaks for all of them: the
//! scheduler plans admissions, preemptions and prefix hits from it alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Positions per block (vLLM's default block size on GPUs).
pub const BLOCK_TOKENS: usize = 16;

/// Blocks needed to hold `n_tokens` positions.
pub fn blocks_for(n_tokens: usize) -> usize {
    n_tokens.div_ceil(BLOCK_TOKENS)
}

/// The error when the pool has no free block: the scheduler preempts a sequence and retries.
#[derive(Debug)]
pub(crate) struct KvExhausted {
    pub capacity_blocks: usize,
}

impl std::fmt::Display for KvExhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the KV cache is full ({} blocks of {BLOCK_TOKENS} tokens); raise --kv-cache-tokens",
            self.capacity_blocks
        )
    }
}

impl std::error::Error for KvExhausted {}

/// One block's memory: `(n_layers, 2, n_kv_heads, BLOCK_TOKENS, head_dim)` f16. Shared
/// (read-only) while it is in the prefix cache; written only while one cache owns it alone.
type Block = Arc<[f16]>;

/// The key of the chain's first block's parent.
const ROOT_KEY: u64 = 0xcbf2_9ce4_8422_2325;

/// A pool of KV blocks for one model shard. One block holds, for every layer, the keys and
/// then the values of [`BLOCK_TOKENS`] positions, head by head:
/// `(n_layers, 2, n_kv_heads, BLOCK_TOKENS, head_dim)` f16 (llama.cpp's default cache type),
/// so attention for one KV head reads contiguous memory.
pub struct KvPool {
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Most blocks alive at once; `usize::MAX` for an unbounded pool.
    capacity_blocks: usize,
    /// Whether full blocks are registered in (and adopted from) the prefix cache.
    prefix_cache: AtomicBool,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    /// Memory of blocks nobody holds and nothing caches, reused before new memory is touched.
    free: Vec<Block>,
    /// Distinct blocks held by live caches.
    referenced: usize,
    /// Blocks with memory: held, cached, or in `free`.
    allocated: usize,
    /// The prefix cache: full blocks by key.
    cached: HashMap<u64, CachedBlock>,
    /// Ticks of the LRU order.
    clock: u64,
    /// Cached blocks evicted so far.
    evictions: u64,
}

/// A block in the prefix cache: its memory and what its key was made of (compared on every
/// hit, so a hash collision can never hand out another prefix's keys and values).
struct CachedBlock {
    block: Block,
    parent: u64,
    tokens: [u32; BLOCK_TOKENS],
    prefill_positions: usize,
    /// Live caches holding it.
    users: usize,
    /// When its last user let go (the LRU order).
    last_used: u64,
}

/// The longest cached prefix of a token sequence ([`KvPool::cached_prefix`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens covered by cached blocks (a multiple of [`BLOCK_TOKENS`]).
    pub tokens: usize,
    /// How many of those blocks live caches hold already: adopting them takes no capacity.
    pub held_blocks: usize,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KvPool({} of {} blocks used)",
            self.used_blocks(),
            self.capacity_blocks
        )
    }
}

/// Positions of block `index` computed in prompt order for a sequence whose prompt has
/// `prompt_tokens` tokens: a one-token prompt runs in decode order, like every generated
/// token ([`crate::runtime::model::llama::Llama::forward_stage`]).
fn prefill_positions(prompt_tokens: usize, index: usize) -> usize {
    if prompt_tokens <= 1 {
        0
    } else {
        prompt_tokens
            .saturating_sub(index * BLOCK_TOKENS)
            .min(BLOCK_TOKENS)
    }
}

/// A full block's key: FNV-1a (64-bit) over its parent's key, its prompt-order positions
/// and its tokens, the chained hash vLLM's prefix cache uses (with FNV instead of SHA-256:
/// hits compare the content too).
fn block_key(parent: u64, prefill_positions: usize, tokens: &[u32]) -> u64 {
    let mut hash = ROOT_KEY;
    let mut eat = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&parent.to_le_bytes());
    eat(&(prefill_positions as u64).to_le_bytes());
    for token in tokens {
        eat(&token.to_le_bytes());
    }
    hash
}

impl KvPool {
    /// A pool for `n_layers` layers of `n_kv_heads` heads (this shard's) of `head_dim`, with
    /// room for `capacity_tokens` positions (rounded down to whole blocks; `None`: no limit).
    /// Memory is taken as blocks are first used, not up front. The prefix cache starts off.
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        capacity_tokens: Option<usize>,
    ) -> Arc<KvPool> {
        Arc::new(KvPool {
            n_layers,
            n_kv_heads,
            head_dim,
            capacity_blocks: capacity_tokens.map_or(usize::MAX, |t| t / BLOCK_TOKENS),
            prefix_cache: AtomicBool::new(false),
            state: Mutex::new(PoolState::default()),
        })
    }

    /// An empty cache drawing from this pool.
    pub fn new_cache(self: &Arc<KvPool>) -> KvCache {
        KvCache {
            pool: Arc::clone(self),
            blocks: Vec::new(),
            keys: Vec::new(),
            chain: Vec::new(),
            tokens: Vec::new(),
            n_tokens: 0,
            prompt_tokens: None,
        }
    }

    /// Turns the prefix cache on or off for blocks filled from now on. Only a bounded pool
    /// caches (an unbounded one would never evict); returns whether the cache is on.
    pub fn set_prefix_cache(&self, enabled: bool) -> bool {
        let on = enabled && self.capacity_blocks != usize::MAX;
        self.prefix_cache.store(on, Ordering::SeqCst);
        on
    }

    /// Whether full blocks are cached for reuse.
    pub fn prefix_cache(&self) -> bool {
        self.prefix_cache.load(Ordering::SeqCst)
    }

    /// Capacity in blocks (`usize::MAX` when unbounded).
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Blocks held by live caches (a block several caches share counts once).
    pub fn used_blocks(&self) -> usize {
        self.lock().referenced
    }

    /// Blocks that can still be handed out (cached blocks nobody holds are evicted on demand,
    /// so they count as free).
    pub fn free_blocks(&self) -> usize {
        self.capacity_blocks.saturating_sub(self.used_blocks())
    }

    /// Blocks in the prefix cache, held or not.
    pub fn cached_blocks(&self) -> usize {
        self.lock().cached.len()
    }

    /// Cached blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.lock().evictions
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elements() * 2
    }

    fn block_elements(&self) -> usize {
        self.n_layers * 2 * BLOCK_TOKENS * self.n_kv_heads * self.head_dim
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // A poisoned lock only means a panic elsewhere; the counters are still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The longest chain of cached full blocks that starts `tokens`, for a sequence whose
    /// prompt has `prompt_tokens` tokens (the blocks must have been computed in the order
    /// this sequence's own prefill would use). Changes nothing; a miss when the cache is off.
    pub fn cached_prefix(&self, tokens: &[u32], prompt_tokens: usize) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.prefix_cache() {
            return hit;
        }
        let state = self.lock();
        let mut parent = ROOT_KEY;
        for (index, block_tokens) in tokens.chunks_exact(BLOCK_TOKENS).enumerate() {
            let prefill = prefill_positions(prompt_tokens, index);
            let key = block_key(parent, prefill, block_tokens);
            match state.cached.get(&key) {
                Some(cached) if cached.matches(parent, prefill, block_tokens) => {
                    hit.tokens += BLOCK_TOKENS;
                    hit.held_blocks += usize::from(cached.users > 0);
                    parent = key;
                }
                _ => break,
            }
        }
        hit
    }

    /// A block for a cache: free memory, new memory while under capacity, else the least
    /// recently used cached block nobody holds.
    fn take(&self) -> Result<Block, KvExhausted> {
        let mut state = self.lock();
        if state.referenced >= self.capacity_blocks {
            return Err(KvExhausted {
                capacity_blocks: self.capacity_blocks,
            });
        }
        state.referenced += 1;
        if let Some(block) = state.free.pop() {
            return Ok(block);
        }
        if state.allocated >= self.capacity_blocks {
            let victim = state
                .cached
                .iter()
                .filter(|(_, c)| c.users == 0)
                .min_by_key(|(_, c)| c.last_used)
                .map(|(key, _)| *key);
            if let Some(cached) = victim.and_then(|key| state.cached.remove(&key)) {
                state.evictions += 1;
                return Ok(cached.block);
            }
        }
        state.allocated += 1;
        Ok(vec![f16::ZERO; self.block_elements()].into())
    }
}

impl CachedBlock {
    fn matches(&self, parent: u64, prefill_positions: usize, tokens: &[u32]) -> bool {
        self.parent == parent
            && self.prefill_positions == prefill_positions
            && self.tokens[..] == *tokens
    }
}

/// A sequence's keys and values for some layers and positions of one shard, as a prefill
/// replica hands them to a decode replica (prefill/decode disaggregation) while its prefill
/// produces them: the tokens at those positions, the prompt length (so the decode side
/// computes and caches exactly as the prefill side would have; the transfer of a sequence
/// is complete when its parts cover every layer at positions `0..prompt_tokens`), and the
/// f16 bits `(layers, 2, n_kv_heads, n_tokens, head_dim)` — keys then values,
/// position-major per head, whatever the block layout of either side.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvTransfer {
    /// The tokens at positions `first_position..first_position + tokens.len()`.
    pub tokens: Vec<u32>,
    pub first_position: usize,
    pub prompt_tokens: usize,
    /// The shard's layers carried (indices of the shard's own layers).
    pub layers: std::ops::Range<usize>,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// f16 bit patterns.
    pub values: Vec<u16>,
}

impl KvTransfer {
    /// Bytes of keys and values carried.
    pub fn kv_bytes(&self) -> usize {
        self.values.len() * 2
    }

    /// One transfer of every layer at every prompt position from `parts` that cover them
    /// (an [`crate::runtime::exec::handoff::Inbox::take`]'s), for a shard of `n_layers`
    /// layers × `n_kv_heads` × `head_dim`: put together in a host cache, checked as
    /// [`KvCache::import`] checks them. What a device rank writes into its own cache.
    ///
    /// Errors: no parts, those of [`KvCache::import`].
    pub fn assemble(
        parts: &[KvTransfer],
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<KvTransfer> {
        if parts.is_empty() {
            bail!("a KV transfer of no parts");
        }
        let pool = KvPool::new(n_layers, n_kv_heads, head_dim, None);
        let mut cache = pool.new_cache();
        for part in parts {
            cache.import(part)?;
        }
        cache.finish_import();
        cache.export(0..n_layers, 0..cache.n_tokens)
    }

    /// Splits the transfer into parts of at most `max_bytes` each (one position of one
    /// layer at least, whatever the limit): by layer ranges while a whole layer fits, else
    /// each layer by position ranges. The parts cover what `self` covers, with the same
    /// bits, so an inbox takes them as it would take `self`.
    pub fn split(self, max_bytes: usize) -> Vec<KvTransfer> {
        let n_tokens = self.tokens.len();
        if self.kv_bytes() <= max_bytes || n_tokens == 0 || self.layers.is_empty() {
            return vec![self];
        }
        // Values of one layer's keys and values at one position, and at every position.
        let position_values = 2 * self.n_kv_heads * self.head_dim;
        let layer_values = position_values * n_tokens;
        let part = |layers: std::ops::Range<usize>, positions: std::ops::Range<usize>| {
            let mut values = Vec::with_capacity(layers.len() * position_values * positions.len());
            for layer in layers.clone() {
                let at = (layer - self.layers.start) * layer_values;
                // `(2, n_kv_heads)` rows of `(n_tokens, head_dim)` each.
                for row in self.values[at..at + layer_values].chunks_exact(n_tokens * self.head_dim)
                {
                    values.extend_from_slice(
                        &row[positions.start * self.head_dim..positions.end * self.head_dim],
                    );
                }
            }
            KvTransfer {
                tokens: self.tokens[positions.clone()].to_vec(),
                first_position: self.first_position + positions.start,
                prompt_tokens: self.prompt_tokens,
                layers,
                n_kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
                values,
            }
        };
        let layers_per_part = max_bytes / (layer_values * 2);
        if layers_per_part > 0 {
            return self
                .layers
                .clone()
                .step_by(layers_per_part)
                .map(|l| part(l..(l + layers_per_part).min(self.layers.end), 0..n_tokens))
                .collect();
        }
        let positions_per_part = (max_bytes / (position_values * 2)).max(1);
        let mut parts = Vec::new();
        for layer in self.layers.clone() {
            for p in (0..n_tokens).step_by(positions_per_part) {
                parts.push(part(
                    layer..layer + 1,
                    p..(p + positions_per_part).min(n_tokens),
                ));
            }
        }
        parts
    }
}

/// One sequence's KV cache: its block table and how many positions are stored. Dropping it
/// returns its blocks to the pool (cached ones stay cached until evicted).
pub struct KvCache {
    pool: Arc<KvPool>,
    blocks: Vec<Block>,
    /// Per block: its key in the pool's prefix cache, when it is registered there.
    keys: Vec<Option<u64>>,
    /// The chained key of every full block, registered or not.
    chain: Vec<u64>,
    /// The tokens whose positions are stored.
    tokens: Vec<u32>,
    /// Positions stored.
    pub n_tokens: usize,
    /// Positions of the sequence's prompt: they are computed in prompt order, every later
    /// position in decode order (attention sums in the order llama.cpp uses for each,
    /// [`crate::runtime::model::llama::Llama::forward_stage`]). `None` until the first step, which
    /// sets it to its own length; a sequence prefilled in chunks, or recomputed after
    /// preemption (prompt and generated tokens together), sets it first, so every position
    /// gets the bits it would have had.
    pub prompt_tokens: Option<usize>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KvCache({} tokens in {} blocks)",
            self.n_tokens,
            self.blocks.len()
        )
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        // Last blocks first: a chain's tail is evicted before its head.
        for (block, key) in self.blocks.drain(..).zip(self.keys.drain(..)).rev() {
            let cached = key.and_then(|key| state.cached.get_mut(&key));
            let released = match cached {
                Some(cached) => {
                    cached.users -= 1;
                    cached.users == 0
                }
                None => {
                    state.free.push(block);
                    true
                }
            };
            if released {
                state.referenced -= 1;
                state.clock += 1;
                let clock = state.clock;
                if let Some(cached) = key.and_then(|key| state.cached.get_mut(&key)) {
                    cached.last_used = clock;
                }
            }
        }
    }
}

impl KvCache {
    /// Makes room for `n_tokens` positions in all, taking blocks from the pool.
    ///
    /// Errors: [`KvExhausted`] when the pool has no free block (the blocks taken so far stay
    /// with the cache).
    pub fn reserve(&mut self, n_tokens: usize) -> Result<()> {
        while self.blocks.len() < blocks_for(n_tokens) {
            self.blocks.push(self.pool.take()?);
            self.keys.push(None);
        }
        Ok(())
    }

    /// The identities of this cache's blocks, in position order: stable for the pool's
    /// life (a pool never frees block memory: freed blocks are reused, evicted ones
    /// reassigned), two caches sharing a block (the prefix cache) see the same identity,
    /// and a pool of capacity `n` blocks shows at most `n` identities. A device cache that
    /// keeps its own memory maps them to its block slots (the ledger pool of
    /// [`crate::runtime::exec::forward::BackendExecutor`]).
    pub fn block_ids(&self) -> Vec<usize> {
        self.blocks
            .iter()
            .map(|block| Arc::as_ptr(block).cast::<f16>() as usize)
            .collect()
    }

    /// Starts this empty cache with the cached blocks of `tokens` (whole blocks, found by
    /// [`KvPool::cached_prefix`] with this cache's `prompt_tokens`): their positions are
    /// stored without computing anything.
    ///
    /// Errors: a cache that is not empty or has no `prompt_tokens`, a partial block, a block
    /// not (or no longer) cached — on a replica's rank, a pool out of step with the driver's.
    pub fn adopt_prefix(&mut self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let Some(prompt_tokens) = self.prompt_tokens else {
            bail!("a cached prefix needs the sequence's prompt length first");
        };
        if self.n_tokens != 0 || !tokens.len().is_multiple_of(BLOCK_TOKENS) {
            bail!(
                "a cached prefix must start an empty cache with whole blocks ({} tokens given, {} stored)",
                tokens.len(),
                self.n_tokens
            );
        }
        let mut state = self.pool.lock();
        let mut parent = ROOT_KEY;
        for (index, block_tokens) in tokens.chunks_exact(BLOCK_TOKENS).enumerate() {
            let prefill = prefill_positions(prompt_tokens, index);
            let key = block_key(parent, prefill, block_tokens);
            let Some(cached) = state
                .cached
                .get_mut(&key)
                .filter(|c| c.matches(parent, prefill, block_tokens))
            else {
                bail!(
                    "block {index} of the cached prefix is not in the prefix cache (this rank's KV pool is out of step with the driver's)"
                );
            };
            cached.users += 1;
            let newly_held = cached.users == 1;
            self.blocks.push(Arc::clone(&cached.block));
            if newly_held {
                state.referenced += 1;
            }
            self.keys.push(Some(key));
            self.chain.push(key);
            parent = key;
        }
        drop(state);
        self.tokens.extend_from_slice(tokens);
        self.n_tokens = tokens.len();
        Ok(())
    }

    /// Records `tokens` as stored after their positions were written (every layer of the
    /// step): counts them, fixes `prompt_tokens` on the first step, and registers each
    /// block this fills in the prefix cache (when the pool's is on and no other block with
    /// the same key is there).
    pub fn commit(&mut self, tokens: &[u32]) {
        let prompt_tokens = *self.prompt_tokens.get_or_insert(tokens.len());
        self.tokens.extend_from_slice(tokens);
        self.n_tokens += tokens.len();
        let caching = self.pool.prefix_cache();
        while self.chain.len() < self.n_tokens / BLOCK_TOKENS {
            let index = self.chain.len();
            let parent = index.checked_sub(1).map_or(ROOT_KEY, |p| self.chain[p]);
            let block_tokens = &self.tokens[index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS];
            let prefill = prefill_positions(prompt_tokens, index);
            let key = block_key(parent, prefill, block_tokens);
            self.chain.push(key);
            if !caching || self.keys[index].is_some() {
                continue;
            }
            let mut state = self.pool.lock();
            if let std::collections::hash_map::Entry::Vacant(slot) = state.cached.entry(key) {
                slot.insert(CachedBlock {
                    block: Arc::clone(&self.blocks[index]),
                    parent,
                    tokens: std::array::from_fn(|i| block_tokens[i]),
                    prefill_positions: prefill,
                    users: 1,
                    last_used: 0,
                });
                self.keys[index] = Some(key);
            }
        }
    }

    /// The block and offset of `(layer, keys or values, kv_head, position)`.
    fn offset(&self, layer: usize, values: bool, head: usize, position: usize) -> (usize, usize) {
        let pool = &self.pool;
        let slot = position % BLOCK_TOKENS;
        let rows = ((layer * 2 + usize::from(values)) * pool.n_kv_heads + head) * BLOCK_TOKENS;
        (position / BLOCK_TOKENS, (rows + slot) * pool.head_dim)
    }

    /// The key `(head_dim)` of KV head `head` at `position` in `layer`.
    pub fn key(&self, layer: usize, head: usize, position: usize) -> &[f16] {
        let (block, at) = self.offset(layer, false, head, position);
        &self.blocks[block][at..at + self.pool.head_dim]
    }

    /// The value `(head_dim)` of KV head `head` at `position` in `layer`.
    pub fn value(&self, layer: usize, head: usize, position: usize) -> &[f16] {
        let (block, at) = self.offset(layer, true, head, position);
        &self.blocks[block][at..at + self.pool.head_dim]
    }

    /// Stores `keys` and `values` (`(count, n_kv_heads · head_dim)` f32, rounded to f16) of `layer` at
    /// positions `first..first + count`, which [`KvCache::reserve`] has made room for.
    ///
    /// Errors: a position beyond the reserved blocks, or in a block shared through the
    /// prefix cache (those are full and never written).
    pub fn store(
        &mut self,
        layer: usize,
        first: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let (head_dim, kv_dim) = (
            self.pool.head_dim,
            self.pool.n_kv_heads * self.pool.head_dim,
        );
        let count = keys.len() / kv_dim;
        if blocks_for(first + count) > self.blocks.len() {
            bail!(
                "KV positions {first}..{} are not reserved ({} blocks held)",
                first + count,
                self.blocks.len()
            );
        }
        for (i, (k, v)) in keys
            .chunks_exact(kv_dim)
            .zip(values.chunks_exact(kv_dim))
            .enumerate()
        {
            for (rows, values) in [(k, false), (v, true)] {
                for (head, row) in rows.chunks_exact(head_dim).enumerate() {
                    let (block, at) = self.offset(layer, values, head, first + i);
                    let Some(memory) = Arc::get_mut(&mut self.blocks[block]) else {
                        bail!(
                            "KV position {} lies in a block shared through the prefix cache",
                            first + i
                        );
                    };
                    // Round to nearest even, F16C eight at a time where the CPU has it.
                    memory[at..at + head_dim].convert_from_f32_slice(row);
                }
            }
        }
        Ok(())
    }

    /// The tokens whose positions are stored, in position order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens[..self.n_tokens.min(self.tokens.len())]
    }

    /// Blocks held.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The stored `positions` of layers `layers` (of this shard) as a [`KvTransfer`]: what
    /// a prefill replica sends a decode replica, chunk by chunk and layer by layer as its
    /// prefill produces them. Errors: a layer range outside the pool's layers, positions
    /// not stored yet.
    pub fn export(
        &self,
        layers: std::ops::Range<usize>,
        positions: std::ops::Range<usize>,
    ) -> Result<KvTransfer> {
        if positions.start > positions.end || positions.end > self.n_tokens {
            bail!(
                "positions {}..{} are not all stored ({} are)",
                positions.start,
                positions.end,
                self.n_tokens
            );
        }
        self.export_positions(layers, positions.clone(), self.tokens[positions].to_vec())
    }

    /// The keys and values of layers `layers` that a forward pass in progress stored for
    /// `tokens` at positions `n_tokens..n_tokens + tokens.len()`, before it commits them
    /// (see `Llama::forward_stage_observed`). Errors: a layer range outside the pool's
    /// layers, positions beyond the blocks held.
    pub fn export_pending(
        &self,
        layers: std::ops::Range<usize>,
        tokens: &[u32],
    ) -> Result<KvTransfer> {
        let positions = self.n_tokens..self.n_tokens + tokens.len();
        if positions.end > self.blocks.len() * BLOCK_TOKENS {
            bail!(
                "positions {}..{} lie beyond the {} blocks held",
                positions.start,
                positions.end,
                self.blocks.len()
            );
        }
        self.export_positions(layers, positions, tokens.to_vec())
    }

    fn export_positions(
        &self,
        layers: std::ops::Range<usize>,
        positions: std::ops::Range<usize>,
        tokens: Vec<u32>,
    ) -> Result<KvTransfer> {
        let pool = &self.pool;
        if layers.start > layers.end || layers.end > pool.n_layers {
            bail!(
                "layers {}..{} are outside this pool's {} layers",
                layers.start,
                layers.end,
                pool.n_layers
            );
        }
        let rows = layers.len() * 2 * pool.n_kv_heads;
        let mut values = Vec::with_capacity(rows * positions.len() * pool.head_dim);
        for layer in layers.clone() {
            for values_half in [false, true] {
                for head in 0..pool.n_kv_heads {
                    for position in positions.clone() {
                        let (block, at) = self.offset(layer, values_half, head, position);
                        values.extend_from_slice(&self.blocks[block][at..at + pool.head_dim]);
                    }
                }
            }
        }
        Ok(KvTransfer {
            tokens,
            first_position: positions.start,
            prompt_tokens: self.prompt_tokens.unwrap_or(self.n_tokens),
            layers,
            n_kv_heads: pool.n_kv_heads,
            head_dim: pool.head_dim,
            values: values.iter().map(|v| v.to_bits()).collect(),
        })
    }

    /// Writes `transfer`'s layers and positions into this cache: the first part of a
    /// sequence starts an empty cache (reserving its prompt's blocks and fixing its prompt
    /// length), later ones must carry the same prompt length; parts may come in any order
    /// and may repeat (a recomputed prefill sends identical values again). Once the parts
    /// cover every layer at every prompt position, [`KvCache::finish_import`] counts the
    /// positions as stored.
    ///
    /// Errors: a transfer for another geometry or prompt, layers or positions outside it, a
    /// full pool ([`KvExhausted`]).
    pub fn import(&mut self, transfer: &KvTransfer) -> Result<()> {
        let pool = Arc::clone(&self.pool);
        let n = transfer.tokens.len();
        if transfer.n_kv_heads != pool.n_kv_heads
            || transfer.head_dim != pool.head_dim
            || transfer.layers.end > pool.n_layers
            || transfer.layers.start > transfer.layers.end
        {
            bail!(
                "a KV transfer of layers {}..{} × {} KV heads × {} dims does not fit this shard ({} layers × {} KV heads × {} dims): the two replicas must shard the model alike",
                transfer.layers.start,
                transfer.layers.end,
                transfer.n_kv_heads,
                transfer.head_dim,
                pool.n_layers,
                pool.n_kv_heads,
                pool.head_dim
            );
        }
        let expected = transfer.layers.len() * 2 * pool.n_kv_heads * n * pool.head_dim;
        if transfer.values.len() != expected {
            bail!(
                "a KV transfer carries {} values, expected {expected}",
                transfer.values.len()
            );
        }
        if transfer.first_position + n > transfer.prompt_tokens {
            bail!(
                "a KV transfer of positions {}..{} for a prompt of {}",
                transfer.first_position,
                transfer.first_position + n,
                transfer.prompt_tokens
            );
        }
        if self.tokens.is_empty() && self.n_tokens == 0 {
            self.prompt_tokens = Some(transfer.prompt_tokens);
            self.reserve(transfer.prompt_tokens)?;
            self.tokens = vec![0; transfer.prompt_tokens];
        } else if self.prompt_tokens != Some(transfer.prompt_tokens) || self.n_tokens != 0 {
            bail!("a KV transfer for another prompt than the cache's");
        }
        let first = transfer.first_position;
        self.tokens[first..first + n].copy_from_slice(&transfer.tokens);
        let mut chunks = transfer.values.chunks_exact(pool.head_dim);
        for layer in transfer.layers.clone() {
            for values_half in [false, true] {
                for head in 0..pool.n_kv_heads {
                    for position in first..first + n {
                        let (block, at) = self.offset(layer, values_half, head, position);
                        let row = chunks.next().expect("length checked above");
                        let Some(memory) = Arc::get_mut(&mut self.blocks[block]) else {
                            bail!("KV position {position} lies in a shared block");
                        };
                        for (slot, bits) in memory[at..at + pool.head_dim].iter_mut().zip(row) {
                            *slot = f16::from_bits(*bits);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts the imported positions as stored (and registers their full blocks in the
    /// prefix cache), after [`KvCache::import`] brought every layer and position.
    pub fn finish_import(&mut self) {
        let tokens = std::mem::take(&mut self.tokens);
        self.commit(&tokens);
    }

    /// Bytes held (whole blocks).
    pub fn bytes(&self) -> usize {
        self.blocks.len() * self.pool.block_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_reused_and_capped() {
        let pool = KvPool::new(2, 2, 2, Some(3 * BLOCK_TOKENS + 5));
        assert_eq!(pool.capacity_blocks(), 3);
        let mut a = pool.new_cache();
        a.reserve(BLOCK_TOKENS + 1).expect("two blocks");
        assert_eq!(
            (a.n_blocks(), pool.used_blocks(), pool.free_blocks()),
            (2, 2, 1)
        );
        let mut b = pool.new_cache();
        b.reserve(1).expect("one block");
        let error = b.reserve(BLOCK_TOKENS + 1).expect_err("pool exhausted");
        assert!(error.downcast_ref::<KvExhausted>().is_some(), "{error}");
        drop(a);
        assert_eq!(pool.used_blocks(), 1);
        b.reserve(3 * BLOCK_TOKENS).expect("blocks returned by `a`");
        assert_eq!(pool.free_blocks(), 0);
    }

    #[test]
    fn rows_land_at_their_position_across_blocks() {
        // Two KV heads of two dims: row `p` holds `4p..4p+4`, head 1 the last two.
        let pool = KvPool::new(2, 2, 2, None);
        let mut cache = pool.new_cache();
        let n = BLOCK_TOKENS + 3;
        cache.reserve(n).expect("unbounded");
        let keys: Vec<f32> = (0..n * 4).map(|i| i as f32).collect();
        let values: Vec<f32> = keys.iter().map(|k| -k).collect();
        cache.store(1, 0, &keys, &values).expect("reserved");
        for p in 0..n {
            assert_eq!(cache.key(1, 0, p)[1].to_f32(), (4 * p + 1) as f32);
            assert_eq!(cache.key(1, 1, p)[0].to_f32(), (4 * p + 2) as f32);
            assert_eq!(cache.value(1, 1, p)[1].to_f32(), -((4 * p + 3) as f32));
            assert_eq!(cache.key(0, 0, p)[0].to_f32(), 0.0, "layer 0 untouched");
        }
        assert!(
            cache
                .store(0, 2 * BLOCK_TOKENS, &keys[..4], &values[..4])
                .is_err()
        );
    }

    /// A cache holding `tokens` (a prompt of their length) in a pool of `pool`'s.
    fn filled(pool: &Arc<KvPool>, tokens: &[u32]) -> KvCache {
        let mut cache = pool.new_cache();
        cache.prompt_tokens = Some(tokens.len());
        cache.reserve(tokens.len()).expect("room");
        cache.commit(tokens);
        cache
    }

    #[test]
    fn full_prompt_blocks_are_shared_counted_once_and_evicted_tail_first() {
        let pool = KvPool::new(1, 1, 2, Some(6 * BLOCK_TOKENS));
        assert!(pool.set_prefix_cache(true));
        let prompt: Vec<u32> = (0..2 * BLOCK_TOKENS as u32 + 3).collect();
        let a = filled(&pool, &prompt);
        assert_eq!((pool.used_blocks(), pool.cached_blocks()), (3, 2));
        let hit = pool.cached_prefix(&prompt, prompt.len());
        assert_eq!(
            hit,
            PrefixHit {
                tokens: 2 * BLOCK_TOKENS,
                held_blocks: 2
            }
        );
        // The same tokens as a prompt of another length: block 1 was computed in another
        // order for it (a longer prompt reaches into it), so only block 0 matches... and a
        // one-token prompt (decode order everywhere) matches nothing.
        assert_eq!(
            pool.cached_prefix(&prompt, BLOCK_TOKENS + 4).tokens,
            BLOCK_TOKENS
        );
        assert_eq!(pool.cached_prefix(&prompt, 1).tokens, 0);
        let mut b = pool.new_cache();
        b.prompt_tokens = Some(prompt.len());
        b.adopt_prefix(&prompt[..2 * BLOCK_TOKENS]).expect("cached");
        assert_eq!(b.n_tokens, 2 * BLOCK_TOKENS);
        assert_eq!(pool.used_blocks(), 3, "shared blocks count once");
        b.reserve(prompt.len()).expect("room");
        assert!(
            b.store(0, BLOCK_TOKENS, &[1.0, 2.0], &[3.0, 4.0]).is_err(),
            "a shared block is never written"
        );
        b.store(0, 2 * BLOCK_TOKENS, &[1.0, 2.0], &[3.0, 4.0])
            .expect("its own block");
        drop(a);
        assert_eq!(pool.used_blocks(), 3, "b still holds the shared blocks");
        drop(b);
        assert_eq!((pool.used_blocks(), pool.cached_blocks()), (0, 2));
        assert_eq!(
            pool.free_blocks(),
            6,
            "cached blocks nobody holds count as free"
        );
        // Filling the pool evicts the chain's tail (block 1) before its head.
        let other: Vec<u32> = (1000..1000 + 5 * BLOCK_TOKENS as u32).collect();
        let c = filled(&pool, &other);
        assert_eq!(pool.evictions(), 1);
        assert_eq!(
            pool.cached_prefix(&prompt, prompt.len()).tokens,
            BLOCK_TOKENS
        );
        drop(c);
        let mut d = pool.new_cache();
        d.prompt_tokens = Some(prompt.len());
        assert!(
            d.adopt_prefix(&prompt[..2 * BLOCK_TOKENS]).is_err(),
            "block 1 is gone"
        );
    }

    #[test]
    fn a_pool_caches_only_when_bounded_and_asked() {
        let unbounded = KvPool::new(1, 1, 2, None);
        assert!(!unbounded.set_prefix_cache(true));
        let tokens: Vec<u32> = (0..BLOCK_TOKENS as u32).collect();
        drop(filled(&unbounded, &tokens));
        assert_eq!(unbounded.cached_blocks(), 0);
        let off = KvPool::new(1, 1, 2, Some(4 * BLOCK_TOKENS));
        drop(filled(&off, &tokens));
        assert_eq!(
            (off.cached_blocks(), off.cached_prefix(&tokens, 16).tokens),
            (0, 0)
        );
    }

    /// The value a transfer holds for (layer, k/v, head, position, dim): all distinct.
    fn coded(layer: usize, kv: usize, head: usize, position: usize, dim: usize) -> u16 {
        (((layer * 2 + kv) * 3 + head) * 64 + position * 4 + dim) as u16
    }

    #[test]
    fn a_split_transfer_carries_the_same_bits_at_the_same_layers_and_positions() {
        let (heads, dim, first) = (3, 4, 5);
        let (layers, positions) = (2..6, first..first + 11);
        let mut values = Vec::new();
        for layer in layers.clone() {
            for kv in 0..2 {
                for head in 0..heads {
                    for position in positions.clone() {
                        values.extend((0..dim).map(|d| coded(layer, kv, head, position, d)));
                    }
                }
            }
        }
        let whole = KvTransfer {
            tokens: positions.clone().map(|p| 1000 + p as u32).collect(),
            first_position: first,
            prompt_tokens: 40,
            layers: layers.clone(),
            n_kv_heads: heads,
            head_dim: dim,
            values,
        };
        let layer_bytes = 2 * heads * 11 * dim * 2;
        // Whole layers (two per part), then positions inside a layer, then the floor of
        // one position of one layer.
        for (max_bytes, n_parts) in [
            (whole.kv_bytes(), 1),
            (2 * layer_bytes + 1, 2),
            (layer_bytes / 2, 4 * 3),
            (1, 4 * 11),
        ] {
            let parts = whole.clone().split(max_bytes);
            assert_eq!(parts.len(), n_parts, "limit {max_bytes}");
            let mut seen = std::collections::HashSet::new();
            for part in &parts {
                assert!(part.kv_bytes() <= max_bytes.max(2 * heads * dim * 2));
                let n = part.tokens.len();
                assert_eq!(part.values.len(), part.layers.len() * 2 * heads * n * dim);
                let mut at = part.values.iter();
                for layer in part.layers.clone() {
                    for kv in 0..2 {
                        for head in 0..heads {
                            for position in part.first_position..part.first_position + n {
                                for d in 0..dim {
                                    assert_eq!(
                                        at.next(),
                                        Some(&coded(layer, kv, head, position, d))
                                    );
                                }
                                if kv == 0 && head == 0 {
                                    assert!(seen.insert((layer, position)), "repeated");
                                    assert_eq!(
                                        part.tokens[position - part.first_position],
                                        1000 + position as u32
                                    );
                                }
                            }
                        }
                    }
                }
            }
            assert_eq!(seen.len(), 4 * 11, "every layer at every position");
        }
    }

    #[test]
    fn split_parts_in_any_order_assemble_into_the_whole_prompt() {
        let (layers, heads, dim, prompt) = (4, 3, 4, 2 * BLOCK_TOKENS + 3);
        let mut values = Vec::new();
        for layer in 0..layers {
            for kv in 0..2 {
                for head in 0..heads {
                    for position in 0..prompt {
                        values.extend((0..dim).map(|d| coded(layer, kv, head, position, d)));
                    }
                }
            }
        }
        let whole = KvTransfer {
            tokens: (0..prompt as u32).map(|p| 7 * p).collect(),
            first_position: 0,
            prompt_tokens: prompt,
            layers: 0..layers,
            n_kv_heads: heads,
            head_dim: dim,
            values,
        };
        // Parts of a layer's positions, last first.
        let mut parts = whole.clone().split(whole.kv_bytes() / layers / 3);
        assert!(parts.len() > layers, "{} parts", parts.len());
        parts.reverse();
        let assembled = KvTransfer::assemble(&parts, layers, heads, dim).expect("assemble");
        assert_eq!(assembled.tokens, whole.tokens);
        assert_eq!(
            (
                assembled.first_position,
                assembled.prompt_tokens,
                assembled.layers.clone()
            ),
            (0, prompt, 0..layers)
        );
        assert!(
            assembled.values == whole.values,
            "the same bits in the same places"
        );
        let error = KvTransfer::assemble(&[], layers, heads, dim).expect_err("no parts");
        assert!(error.to_string().contains("no parts"), "{error}");
        let error = KvTransfer::assemble(&parts, layers, 2, dim).expect_err("another geometry");
        assert!(
            error.to_string().contains("must shard the model alike"),
            "{error}"
        );
    }
}

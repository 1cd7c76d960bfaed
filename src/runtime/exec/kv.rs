//! The paged KV cache: keys and values live in fixed-size blocks of [`BLOCK_TOKENS`]
//! positions handed out by a [`KvPool`] with a hard capacity (as vLLM's PagedAttention
//! block manager). A sequence's [`KvCache`] is its block table: position `p` lives in block
//! `p / BLOCK_TOKENS` at slot `p % BLOCK_TOKENS`, so no sequence needs contiguous memory and
//! a finished sequence's blocks go straight back to the pool for the next one.
//!
//! Every rank of a replica has a pool of the same capacity and sees the same sequence of
//! allocations (the driver's steps), so the driver's pool speaks for all of them: the
//! scheduler plans admissions and preemptions from it alone.

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
pub struct KvExhausted {
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
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    /// Blocks returned by finished sequences, reused before new memory is touched.
    free: Vec<Box<[f16]>>,
    in_use: usize,
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

impl KvPool {
    /// A pool for `n_layers` layers of `n_kv_heads` heads (this shard's) of `head_dim`, with
    /// room for `capacity_tokens` positions (rounded down to whole blocks; `None`: no limit).
    /// Memory is taken as blocks are first used, not up front.
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
            state: Mutex::new(PoolState::default()),
        })
    }

    /// An empty cache drawing from this pool.
    pub fn new_cache(self: &Arc<KvPool>) -> KvCache {
        KvCache {
            pool: Arc::clone(self),
            blocks: Vec::new(),
            n_tokens: 0,
            prompt_tokens: None,
        }
    }

    /// Capacity in blocks (`usize::MAX` when unbounded).
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Blocks held by live caches.
    pub fn used_blocks(&self) -> usize {
        self.lock().in_use
    }

    /// Blocks that can still be handed out.
    pub fn free_blocks(&self) -> usize {
        self.capacity_blocks.saturating_sub(self.used_blocks())
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

    fn take(&self) -> Result<Box<[f16]>, KvExhausted> {
        let mut state = self.lock();
        if state.in_use >= self.capacity_blocks {
            return Err(KvExhausted {
                capacity_blocks: self.capacity_blocks,
            });
        }
        state.in_use += 1;
        Ok(state
            .free
            .pop()
            .unwrap_or_else(|| vec![f16::ZERO; self.block_elements()].into_boxed_slice()))
    }

    fn give_back(&self, blocks: Vec<Box<[f16]>>) {
        let mut state = self.lock();
        state.in_use -= blocks.len();
        state.free.extend(blocks);
    }
}

/// One sequence's KV cache: its block table and how many positions are stored. Dropping it
/// returns its blocks to the pool.
pub struct KvCache {
    pool: Arc<KvPool>,
    blocks: Vec<Box<[f16]>>,
    /// Positions stored.
    pub n_tokens: usize,
    /// Positions of the sequence's prompt, computed together in its first step; every later
    /// position was a decode step of one token. Attention sums in the order llama.cpp uses
    /// for each ([`crate::runtime::model::llama::Llama::forward_stage`]). `None` until the first step, which
    /// sets it to its own length; a sequence recomputed after preemption (prompt and
    /// generated tokens in one step) sets it first, so its recomputed positions get the
    /// bits its decode steps had.
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
        self.pool.give_back(std::mem::take(&mut self.blocks));
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
        }
        Ok(())
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
    /// Errors: a position beyond the reserved blocks.
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
                    // Round to nearest even, F16C eight at a time where the CPU has it.
                    self.blocks[block][at..at + head_dim].convert_from_f32_slice(row);
                }
            }
        }
        Ok(())
    }

    /// Blocks held.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
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
}

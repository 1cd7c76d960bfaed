//! [`Backend`] on the CPU: buffers are host memory, matrices the engine's [`Weight`]s (their
//! products through the CPU engine's quantized kernels), the rest plain loops in f32 with
//! the KV cache in f16. The reference the CUDA backend is compared with in the tests; the
//! CPU engine proper is `model::llama::Llama::forward`, llama.cpp's numerics bit for bit.

use crate::runtime::formats::ggml::GgmlType;
use std::cell::RefCell;

use anyhow::{Result, bail};
use half::f16;

use super::{AttentionShape, Backend, KV_BLOCK_TOKENS, f32s_of, i32s_of, kv_cache_offset};
use crate::runtime::cpu::mathfn::silu;
use crate::runtime::model::config::RopeStyle;
use crate::runtime::model::weights::Weight;

/// The CPU as a [`Backend`].
#[derive(Debug, Default)]
pub struct CpuBackend;

/// Host memory written through shared references (one op at a time; an op's outputs never
/// alias its inputs).
#[derive(Debug)]
pub struct CpuBuffer(RefCell<Vec<u8>>);

impl CpuBuffer {
    fn f32s(&self) -> Vec<f32> {
        f32s_of(&self.0.borrow())
    }

    fn i32s(&self) -> Vec<i32> {
        i32s_of(&self.0.borrow())
    }

    fn set_f32s(&self, values: &[f32]) {
        let mut bytes = self.0.borrow_mut();
        for (chunk, v) in bytes.chunks_exact_mut(4).zip(values) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
    }

    fn f16_at(&self, index: usize) -> f32 {
        let bytes = self.0.borrow();
        f16::from_bits(u16::from_ne_bytes([bytes[2 * index], bytes[2 * index + 1]])).to_f32()
    }
}

fn index(id: i32, bound: usize, what: &str) -> Result<usize> {
    match usize::try_from(id) {
        Ok(i) if i < bound => Ok(i),
        _ => bail!("{what} {id} is outside 0..{bound}"),
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Matrix = Weight;

    fn matrix_shape(&self, w: &Weight) -> (usize, usize) {
        (w.n_rows, w.n_cols)
    }

    fn name(&self) -> String {
        "cpu".into()
    }

    fn upload(&self, bytes: &[u8]) -> Result<CpuBuffer> {
        Ok(CpuBuffer(RefCell::new(bytes.to_vec())))
    }

    fn zeros(&self, len_bytes: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer(RefCell::new(vec![0; len_bytes])))
    }

    fn download(&self, buffer: &CpuBuffer, len_bytes: usize) -> Result<Vec<u8>> {
        let bytes = buffer.0.borrow();
        if len_bytes > bytes.len() {
            bail!("{len_bytes} bytes asked of a {}-byte buffer", bytes.len());
        }
        Ok(bytes[..len_bytes].to_vec())
    }

    fn upload_matrix(
        &self,
        ty: GgmlType,
        n_rows: usize,
        n_cols: usize,
        bytes: &[u8],
    ) -> Result<Weight> {
        Weight::from_bytes(ty, n_rows, n_cols, bytes.to_vec())
    }

    fn get_rows(
        &self,
        out: &CpuBuffer,
        table: &Weight,
        ids: &CpuBuffer,
        n_ids: usize,
    ) -> Result<()> {
        let ids = ids.i32s();
        let mut rows = vec![0f32; n_ids * table.n_cols];
        for (row, &id) in rows.chunks_exact_mut(table.n_cols).zip(&ids) {
            table.dequantize_row(index(id, table.n_rows, "token id")?, row);
        }
        out.set_f32s(&rows);
        Ok(())
    }

    fn gather_rows(
        &self,
        out: &CpuBuffer,
        x: &CpuBuffer,
        ids: &CpuBuffer,
        n_ids: usize,
        dim: usize,
    ) -> Result<()> {
        let (x, ids) = (x.f32s(), ids.i32s());
        let mut rows = Vec::with_capacity(n_ids * dim);
        for &id in &ids[..n_ids] {
            let r = index(id, x.len() / dim, "row")?;
            rows.extend_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        out.set_f32s(&rows);
        Ok(())
    }

    fn rms_norm(
        &self,
        y: &CpuBuffer,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()> {
        let x = x.f32s();
        let mut out = vec![0f32; n_rows * n_cols];
        crate::runtime::model::llama::rms_norm(
            &x[..n_rows * n_cols],
            &weight.f32s()[..n_cols],
            eps,
            &mut out,
        );
        y.set_f32s(&out);
        Ok(())
    }

    fn matmul(&self, y: &CpuBuffer, w: &Weight, x: &CpuBuffer, n_tokens: usize) -> Result<()> {
        let x = x.f32s();
        let mut out = vec![0f32; n_tokens * w.n_rows];
        w.matmul(&x[..n_tokens * w.n_cols], n_tokens, &mut out);
        y.set_f32s(&out);
        Ok(())
    }

    fn rope(
        &self,
        x: &CpuBuffer,
        positions: &CpuBuffer,
        inv_freqs: &CpuBuffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()> {
        let (mut values, positions, inv_freqs) = (x.f32s(), positions.i32s(), inv_freqs.f32s());
        let half = head_dim / 2;
        for (t, token) in values
            .chunks_exact_mut(n_heads * head_dim)
            .take(n_tokens)
            .enumerate()
        {
            for head in token.chunks_exact_mut(head_dim) {
                for (i, inv_freq) in inv_freqs.iter().take(half).enumerate() {
                    let (sin, cos) = (positions[t] as f32 * inv_freq).sin_cos();
                    let (a, b) = match style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
        x.set_f32s(&values);
        Ok(())
    }

    fn swiglu(&self, out: &CpuBuffer, gate: &CpuBuffer, up: &CpuBuffer, n: usize) -> Result<()> {
        let (gate, up) = (gate.f32s(), up.f32s());
        let values: Vec<f32> = gate[..n]
            .iter()
            .zip(&up[..n])
            .map(|(g, u)| silu(*g) * u)
            .collect();
        out.set_f32s(&values);
        Ok(())
    }

    fn add(&self, x: &CpuBuffer, y: &CpuBuffer, n: usize) -> Result<()> {
        let (mut values, y) = (x.f32s(), y.f32s());
        for (a, b) in values[..n].iter_mut().zip(&y) {
            *a += b;
        }
        x.set_f32s(&values);
        Ok(())
    }

    fn add_bias(
        &self,
        x: &CpuBuffer,
        bias: &CpuBuffer,
        n_rows: usize,
        n_cols: usize,
    ) -> Result<()> {
        let (mut values, bias) = (x.f32s(), bias.f32s());
        for row in values[..n_rows * n_cols].chunks_exact_mut(n_cols) {
            for (v, b) in row.iter_mut().zip(&bias) {
                *v += b;
            }
        }
        x.set_f32s(&values);
        Ok(())
    }

    fn scale_add_rows(
        &self,
        x: &CpuBuffer,
        rows: &CpuBuffer,
        ids: &CpuBuffer,
        weights: &CpuBuffer,
        n_rows: usize,
        dim: usize,
    ) -> Result<()> {
        let (mut values, rows, ids, weights) = (x.f32s(), rows.f32s(), ids.i32s(), weights.f32s());
        for r in 0..n_rows {
            let id = index(ids[r], values.len() / dim, "row")?;
            for i in 0..dim {
                values[id * dim + i] += weights[r] * rows[r * dim + i];
            }
        }
        x.set_f32s(&values);
        Ok(())
    }

    fn store_kv(
        &self,
        k_cache: &CpuBuffer,
        v_cache: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        slots: &CpuBuffer,
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let (k, v, slots) = (k.f32s(), v.f32s(), slots.i32s());
        let width = n_kv_heads * head_dim;
        for (cache, source) in [(k_cache, &k), (v_cache, &v)] {
            let mut cache = cache.0.borrow_mut();
            for t in 0..n_tokens {
                let slot = index(slots[t], cache.len() / 2 / width, "cache slot")?;
                let (block, offset) = (slot / KV_BLOCK_TOKENS, slot % KV_BLOCK_TOKENS);
                for i in 0..width {
                    let (head, d) = (i / head_dim, i % head_dim);
                    let at = kv_cache_offset(block, head, offset, n_kv_heads, head_dim) + d;
                    let bits = f16::from_f32(source[t * width + i]).to_bits();
                    cache[2 * at..2 * at + 2].copy_from_slice(&bits.to_ne_bytes());
                }
            }
        }
        Ok(())
    }

    fn read_kv_blocks(
        &self,
        out: &CpuBuffer,
        cache: &CpuBuffer,
        ids: &CpuBuffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()> {
        let (cache, ids) = (cache.0.borrow(), ids.i32s());
        let mut out = out.0.borrow_mut();
        for (i, &id) in ids[..n_ids].iter().enumerate() {
            let b = index(id, cache.len() / block_bytes, "KV block")?;
            out[i * block_bytes..(i + 1) * block_bytes]
                .copy_from_slice(&cache[b * block_bytes..(b + 1) * block_bytes]);
        }
        Ok(())
    }

    fn write_kv_blocks(
        &self,
        cache: &CpuBuffer,
        rows: &CpuBuffer,
        ids: &CpuBuffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()> {
        let (rows, ids) = (rows.0.borrow(), ids.i32s());
        let mut cache = cache.0.borrow_mut();
        for (i, &id) in ids[..n_ids].iter().enumerate() {
            let b = index(id, cache.len() / block_bytes, "KV block")?;
            cache[b * block_bytes..(b + 1) * block_bytes]
                .copy_from_slice(&rows[i * block_bytes..(i + 1) * block_bytes]);
        }
        Ok(())
    }

    fn attention(
        &self,
        out: &CpuBuffer,
        q: &CpuBuffer,
        k_cache: &CpuBuffer,
        v_cache: &CpuBuffer,
        tables: &CpuBuffer,
        table_rows: &CpuBuffer,
        context_lens: &CpuBuffer,
        shape: &AttentionShape,
    ) -> Result<()> {
        let (q, tables, table_rows, context_lens) = (
            q.f32s(),
            tables.i32s(),
            table_rows.i32s(),
            context_lens.i32s(),
        );
        let AttentionShape {
            n_queries,
            n_heads,
            n_kv_heads,
            head_dim,
            max_blocks,
            scale,
        } = *shape;
        let group = n_heads / n_kv_heads;
        let mut result = vec![0f32; n_queries * n_heads * head_dim];
        for t in 0..n_queries {
            let table = &tables[table_rows[t] as usize * max_blocks..][..max_blocks];
            let context = context_lens[t] as usize;
            for h in 0..n_heads {
                let kv_head = h / group;
                let query = &q[(t * n_heads + h) * head_dim..][..head_dim];
                let slot = |p: usize| {
                    let block = table[p / KV_BLOCK_TOKENS] as usize;
                    kv_cache_offset(block, kv_head, p % KV_BLOCK_TOKENS, n_kv_heads, head_dim)
                };
                let scores: Vec<f32> = (0..context)
                    .map(|p| {
                        let base = slot(p);
                        let dot: f32 = (0..head_dim)
                            .map(|d| query[d] * k_cache.f16_at(base + d))
                            .sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                let row = &mut result[(t * n_heads + h) * head_dim..][..head_dim];
                for (p, w) in weights.iter().enumerate() {
                    let base = slot(p);
                    for (d, o) in row.iter_mut().enumerate() {
                        *o += w / total * v_cache.f16_at(base + d);
                    }
                }
            }
        }
        out.set_f32s(&result);
        Ok(())
    }

    fn argmax(
        &self,
        out: &CpuBuffer,
        logits: &CpuBuffer,
        n_rows: usize,
        n_vocab: usize,
    ) -> Result<()> {
        let logits = logits.f32s();
        let ids: Vec<i32> = logits
            .chunks_exact(n_vocab)
            .take(n_rows)
            .map(|row| crate::runtime::model::sampling::argmax(row) as i32)
            .collect();
        let mut bytes = out.0.borrow_mut();
        for (chunk, id) in bytes.chunks_exact_mut(4).zip(&ids) {
            chunk.copy_from_slice(&id.to_ne_bytes());
        }
        Ok(())
    }
}

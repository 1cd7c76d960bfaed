//! [`Backend`] over the CUDA kernels ([`super::kernels`]) on any [`Device`] that runs them:
//! a GPU (`super::gpu::GpuRunner`, through cudarc) or the host harness
//! (`super::host::HostKernels`, the same sources on CPU threads). Each op is one or two
//! kernel launches with the grid its source documents; buffers stay on the device
//! between ops, and only what a caller downloads comes back.

use anyhow::{Result, bail};

use super::kernels::FAMILIES;
use crate::runtime::backend::{AttentionShape, Backend};
use crate::runtime::cpu::quant::GgmlType;
use crate::runtime::model::config::RopeStyle;

/// One kernel argument on a [`Device`].
pub enum DeviceArg<'a, B> {
    Buffer(&'a B),
    U32(u32),
    F32(f32),
}

/// Memory and kernel launches: what [`KernelBackend`] needs of a device.
pub trait Device {
    type Buffer;

    /// Where the kernels run, for messages.
    fn name(&self) -> String;
    /// A zeroed buffer of `len_bytes`.
    fn alloc(&self, len_bytes: usize) -> Result<Self::Buffer>;
    /// A buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// The first `len_bytes` of `buffer`, after every launch before it finished.
    fn download(&self, buffer: &Self::Buffer, len_bytes: usize) -> Result<Vec<u8>>;
    /// Sums `buffer`'s first `n` f32 across the device's communicator in place
    /// ([`Backend::all_reduce_sum_in_place`]); `false`: it has none.
    ///
    /// Errors: the communicator's.
    fn all_reduce_sum_in_place(&self, buffer: &Self::Buffer, n: usize) -> Result<bool> {
        let _ = (buffer, n);
        Ok(false)
    }
    /// Sends `buffer`'s first `n` f32 to pipeline stage `stage` over the device's pipeline
    /// communicator ([`Backend::send_to_stage`]); `false`: it has none.
    ///
    /// Errors: the communicator's.
    fn send_to_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        let _ = (buffer, n, stage);
        Ok(false)
    }
    /// Receives `n` f32 from pipeline stage `stage` into `buffer`
    /// ([`Backend::recv_from_stage`]); `false`: no pipeline communicator.
    ///
    /// Errors: the communicator's.
    fn recv_from_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        let _ = (buffer, n, stage);
        Ok(false)
    }
    /// Runs `kernel` over `grid` × `block` threads.
    ///
    /// Errors: an unknown kernel, arguments that are not its parameters, a launch failure.
    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[DeviceArg<'_, Self::Buffer>],
    ) -> Result<()>;
    /// Whether [`Device::gemm`] runs here (a GPU with cuBLAS, the host harness); without
    /// it, every product runs on the matrix-vector kernels.
    fn has_gemm(&self) -> bool {
        false
    }
    /// `y[t, r] = Σ_c w[r, c] · x[t, c]` with f32 accumulation: `w` [n_rows, n_cols] and
    /// `x` [n_tokens, n_cols] both of `ty`, row-major; `y` [n_tokens, n_rows] f32.
    ///
    /// Errors: no GEMM here ([`Device::has_gemm`]), buffers too small, the library's error.
    fn gemm(&self, gemm: Gemm<'_, Self::Buffer>) -> Result<()> {
        let _ = gemm;
        bail!("{} has no GEMM library", self.name())
    }
}

/// The element type of a GEMM's inputs ([`Device::gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    F32,
    F16,
    Bf16,
}

impl GemmType {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            GemmType::F32 => 4,
            GemmType::F16 | GemmType::Bf16 => 2,
        }
    }
}

/// One product for [`Device::gemm`]: `y` [n_tokens, n_rows] f32 = `x` [n_tokens, n_cols] ·
/// `w` [n_rows, n_cols]ᵀ, `w` and `x` of `ty`.
pub struct Gemm<'a, B> {
    pub y: &'a B,
    pub w: &'a B,
    pub x: &'a B,
    pub ty: GemmType,
    pub n_tokens: usize,
    pub n_rows: usize,
    pub n_cols: usize,
}

impl<B> Gemm<'_, B> {
    /// Checks that buffers of `len_bytes` hold the product's operands.
    ///
    /// Errors: the operand that is too small.
    pub fn check_sizes(&self, len_bytes: impl Fn(&B) -> usize) -> Result<()> {
        let element = self.ty.bytes();
        for (name, buffer, needed) in [
            ("y", self.y, self.n_tokens * self.n_rows * 4),
            ("w", self.w, self.n_rows * self.n_cols * element),
            ("x", self.x, self.n_tokens * self.n_cols * element),
        ] {
            if len_bytes(buffer) < needed {
                bail!(
                    "GEMM operand {name} holds {} bytes, fewer than the {needed} of {} tokens × {} rows × {} columns",
                    len_bytes(buffer),
                    self.n_tokens,
                    self.n_rows,
                    self.n_cols
                );
            }
        }
        Ok(())
    }
}

/// A device borrowed (one set of compiled kernels shared by several models).
impl<D: Device> Device for &D {
    type Buffer = D::Buffer;

    fn name(&self) -> String {
        (**self).name()
    }

    fn alloc(&self, len_bytes: usize) -> Result<Self::Buffer> {
        (**self).alloc(len_bytes)
    }

    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer> {
        (**self).upload(bytes)
    }

    fn download(&self, buffer: &Self::Buffer, len_bytes: usize) -> Result<Vec<u8>> {
        (**self).download(buffer, len_bytes)
    }

    fn all_reduce_sum_in_place(&self, buffer: &Self::Buffer, n: usize) -> Result<bool> {
        (**self).all_reduce_sum_in_place(buffer, n)
    }

    fn send_to_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        (**self).send_to_stage(buffer, n, stage)
    }

    fn recv_from_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        (**self).recv_from_stage(buffer, n, stage)
    }

    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[DeviceArg<'_, Self::Buffer>],
    ) -> Result<()> {
        (**self).launch(kernel, grid, block, args)
    }

    fn has_gemm(&self) -> bool {
        (**self).has_gemm()
    }

    fn gemm(&self, gemm: Gemm<'_, Self::Buffer>) -> Result<()> {
        (**self).gemm(gemm)
    }
}

/// A weight matrix on a [`Device`].
pub struct DeviceMatrix<B> {
    pub buffer: B,
    pub ty: GgmlType,
    pub n_rows: usize,
    pub n_cols: usize,
}

/// The CUDA kernels as a [`Backend`].
pub struct KernelBackend<D: Device> {
    pub device: D,
    /// Kernels launched and GEMMs enqueued so far ([`Backend::launches`]).
    launches: std::sync::atomic::AtomicU64,
    /// Scratch buffers reused by every product rather than allocated by each, with their
    /// lengths in bytes: a matrix-vector product's activations as Q8_1 blocks, a GEMM's
    /// weights dequantized to f16, a GEMM's activations converted to f16 or bf16. The
    /// kernels of a device run in order on its one stream, so a product has read its scratch
    /// before the next product's first kernel overwrites it.
    scratch: std::sync::Mutex<Scratch<D::Buffer>>,
}

/// A [`KernelBackend`]'s scratch buffers with their lengths in bytes: `[Q8_1 activations,
/// GEMM weights, GEMM activations]`.
type Scratch<B> = [Option<(B, usize)>; 3];

/// The most tokens a product runs on the matrix-vector kernels when the device has a GEMM:
/// larger batches (prefill) dequantize the weights to f16 and run one GEMM. llama.cpp's CUDA
/// backend draws the same line (`MMVQ_MAX_BATCH_SIZE` = 8, `ggml-cuda/mmvq.cuh`).
pub const MAX_MATVEC_TOKENS: usize = 8;

/// Bytes of one Q8_1 activation block (`float d, s; int8 q[32]`, `kernels/matvec.cu`).
const Q8_1_BLOCK_BYTES: usize = 40;

fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow::anyhow!("{what} {n} does not fit a kernel's 32 bits"))
}

fn blocks(n: usize, threads: usize) -> Result<u32> {
    u32_of(n.div_ceil(threads).max(1), "grid size")
}

impl<D: Device> KernelBackend<D> {
    pub fn new(device: D) -> KernelBackend<D> {
        KernelBackend {
            device,
            launches: std::sync::atomic::AtomicU64::new(0),
            scratch: std::sync::Mutex::new([None, None, None]),
        }
    }

    /// The scratch buffers, locked: `[Q8_1 activations, GEMM weights, GEMM activations]`.
    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch<D::Buffer>> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The scratch buffer in `slot`, grown to at least `len_bytes` (its contents are then
    /// undefined, as a new allocation's).
    ///
    /// Errors: the device's allocation.
    fn scratch_of<'s>(
        &self,
        slot: &'s mut Option<(D::Buffer, usize)>,
        len_bytes: usize,
    ) -> Result<&'s D::Buffer> {
        if slot.as_ref().is_none_or(|(_, len)| *len < len_bytes) {
            *slot = Some((self.device.alloc(len_bytes)?, len_bytes));
        }
        match slot {
            Some((buffer, _)) => Ok(buffer),
            None => bail!("a scratch buffer was not allocated"),
        }
    }

    fn count_launch(&self) {
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn threads(kernel: &str) -> u32 {
        FAMILIES
            .iter()
            .flat_map(|f| f.kernels)
            .find(|k| k.name == kernel)
            .map_or(256, |k| k.block_threads)
    }

    fn run(&self, kernel: &str, grid: [u32; 3], args: &[DeviceArg<'_, D::Buffer>]) -> Result<()> {
        self.count_launch();
        self.device
            .launch(kernel, grid, [Self::threads(kernel), 1, 1], args)
    }

    /// [`Backend::read_kv_blocks`] or [`Backend::write_kv_blocks`] (`kernel`): `to`'s blocks
    /// (or rows) from `from`'s rows (or blocks), 32-bit words at a time.
    fn copy_kv_blocks(
        &self,
        kernel: &str,
        to: &D::Buffer,
        from: &D::Buffer,
        ids: &D::Buffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        if !block_bytes.is_multiple_of(4) {
            bail!("a KV block of {block_bytes} bytes is not whole 32-bit words");
        }
        let words = block_bytes / 4;
        self.run(
            kernel,
            [u32_of(n_ids, "blocks")?, blocks(words, 256)?, 1],
            &[
                Buffer(to),
                Buffer(from),
                Buffer(ids),
                U32(u32_of(words, "words")?),
            ],
        )
    }

    /// [`Backend::matmul`] as one GEMM: quantized weights dequantized to f16 (a temporary
    /// [n_rows, n_cols] buffer), activations rounded to the weights' type.
    fn matmul_gemm(
        &self,
        y: &D::Buffer,
        w: &DeviceMatrix<D::Buffer>,
        x: &D::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        let n_cols = u32_of(w.n_cols, "columns")?;
        let dequantize = match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => None,
            GgmlType::Q4_0 => Some("dequantize_q4_0_f16"),
            GgmlType::Q4_1 => Some("dequantize_q4_1_f16"),
            GgmlType::Q8_0 => Some("dequantize_q8_0_f16"),
            GgmlType::Q4K => Some("dequantize_q4_k_f16"),
            GgmlType::Q6K => Some("dequantize_q6_k_f16"),
            other => bail!(
                "the CUDA backend has no GEMM for {other:?} weights (it runs F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K)"
            ),
        };
        let ty = match w.ty {
            GgmlType::F32 => GemmType::F32,
            GgmlType::Bf16 => GemmType::Bf16,
            _ => GemmType::F16,
        };
        let mut scratch = self.scratch();
        let [_, weights_scratch, activations_scratch] = &mut *scratch;
        let expanded = match dequantize {
            Some(kernel) => {
                let out = self.scratch_of(weights_scratch, w.n_rows * w.n_cols * 2)?;
                let row_bytes = u32_of(w.ty.row_bytes(w.n_cols)?, "row bytes")?;
                self.run(
                    kernel,
                    [u32_of(w.n_rows, "rows")?, blocks(w.n_cols, 256)?, 1],
                    &[Buffer(out), Buffer(&w.buffer), U32(n_cols), U32(row_bytes)],
                )?;
                Some(out)
            }
            None => None,
        };
        let n_values = n_tokens * w.n_cols;
        let converted = match ty {
            GemmType::F32 => None,
            GemmType::F16 | GemmType::Bf16 => {
                let out = self.scratch_of(activations_scratch, n_values * 2)?;
                let kernel = if ty == GemmType::F16 {
                    "convert_f32_f16"
                } else {
                    "convert_f32_bf16"
                };
                self.run(
                    kernel,
                    [blocks(n_values, 256)?, 1, 1],
                    &[Buffer(out), Buffer(x), U32(u32_of(n_values, "values")?)],
                )?;
                Some(out)
            }
        };
        self.count_launch();
        self.device.gemm(Gemm {
            y,
            w: expanded.unwrap_or(&w.buffer),
            x: converted.unwrap_or(x),
            ty,
            n_tokens,
            n_rows: w.n_rows,
            n_cols: w.n_cols,
        })
    }
}

impl<D: Device> Backend for KernelBackend<D> {
    type Buffer = D::Buffer;
    type Matrix = DeviceMatrix<D::Buffer>;

    fn name(&self) -> String {
        self.device.name()
    }

    fn launches(&self) -> Option<u64> {
        Some(self.launches.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn upload(&self, bytes: &[u8]) -> Result<D::Buffer> {
        self.device.upload(bytes)
    }

    fn zeros(&self, len_bytes: usize) -> Result<D::Buffer> {
        self.device.alloc(len_bytes)
    }

    fn download(&self, buffer: &D::Buffer, len_bytes: usize) -> Result<Vec<u8>> {
        self.device.download(buffer, len_bytes)
    }

    fn upload_matrix(
        &self,
        ty: GgmlType,
        n_rows: usize,
        n_cols: usize,
        bytes: &[u8],
    ) -> Result<Self::Matrix> {
        ty.check_matrix_bytes(n_rows, n_cols, bytes.len())?;
        Ok(DeviceMatrix {
            buffer: self.device.upload(bytes)?,
            ty,
            n_rows,
            n_cols,
        })
    }

    fn get_rows(
        &self,
        out: &D::Buffer,
        table: &Self::Matrix,
        ids: &D::Buffer,
        n_ids: usize,
    ) -> Result<()> {
        let kernel = match table.ty {
            GgmlType::F32 => "get_rows_f32",
            GgmlType::Q8_0 => "get_rows_q8_0",
            other => bail!(
                "the CUDA backend looks up embeddings in F32 or Q8_0 tables, not {other:?} (dequantize the table to F32 when uploading it)"
            ),
        };
        use DeviceArg::{Buffer, U32};
        self.run(
            kernel,
            [u32_of(n_ids, "rows")?, blocks(table.n_cols, 256)?, 1],
            &[
                Buffer(out),
                Buffer(&table.buffer),
                Buffer(ids),
                U32(u32_of(table.n_cols, "columns")?),
            ],
        )
    }

    fn gather_rows(
        &self,
        out: &D::Buffer,
        x: &D::Buffer,
        ids: &D::Buffer,
        n_ids: usize,
        dim: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "get_rows_f32",
            [u32_of(n_ids, "rows")?, blocks(dim, 256)?, 1],
            &[
                Buffer(out),
                Buffer(x),
                Buffer(ids),
                U32(u32_of(dim, "width")?),
            ],
        )
    }

    fn rms_norm(
        &self,
        y: &D::Buffer,
        x: &D::Buffer,
        weight: &D::Buffer,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()> {
        use DeviceArg::{Buffer, F32, U32};
        self.run(
            "rms_norm_f32",
            [u32_of(n_rows, "rows")?, 1, 1],
            &[
                Buffer(y),
                Buffer(x),
                Buffer(weight),
                U32(u32_of(n_cols, "columns")?),
                F32(eps),
            ],
        )
    }

    fn matmul(
        &self,
        y: &D::Buffer,
        w: &Self::Matrix,
        x: &D::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        let grid = [u32_of(w.n_rows, "rows")?, u32_of(n_tokens, "tokens")?, 1];
        let n_cols = u32_of(w.n_cols, "columns")?;
        let float_kernel = match w.ty {
            GgmlType::F32 => Some("mul_mat_vec_f32"),
            GgmlType::F16 => Some("mul_mat_vec_f16"),
            GgmlType::Bf16 => Some("mul_mat_vec_bf16"),
            _ => None,
        };
        if n_tokens > MAX_MATVEC_TOKENS && self.device.has_gemm() {
            return self.matmul_gemm(y, w, x, n_tokens);
        }
        if let Some(kernel) = float_kernel {
            return self.run(
                kernel,
                grid,
                &[Buffer(y), Buffer(&w.buffer), Buffer(x), U32(n_cols)],
            );
        }
        let kernel = match w.ty {
            GgmlType::Q4_0 => "mul_mat_vec_q4_0_q8_1",
            GgmlType::Q4_1 => "mul_mat_vec_q4_1_q8_1",
            GgmlType::Q8_0 => "mul_mat_vec_q8_0_q8_1",
            GgmlType::Q4K => "mul_mat_vec_q4_k_q8_1",
            GgmlType::Q6K => "mul_mat_vec_q6_k_q8_1",
            other => bail!(
                "the CUDA backend has no matrix-vector kernel for {other:?} weights (it runs F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K)"
            ),
        };
        // The activations as Q8_1 blocks (in the scratch every product reuses), then the
        // integer products.
        let n_blocks = n_tokens * w.n_cols / 32;
        let mut scratch = self.scratch();
        let [q8_1_scratch, _, _] = &mut *scratch;
        let quantized = self.scratch_of(q8_1_scratch, n_blocks * Q8_1_BLOCK_BYTES)?;
        self.run(
            "quantize_q8_1",
            [u32_of(n_blocks, "blocks")?, 1, 1],
            &[
                Buffer(quantized),
                Buffer(x),
                U32(u32_of(n_tokens * w.n_cols, "values")?),
            ],
        )?;
        let row_bytes = u32_of(w.ty.row_bytes(w.n_cols)?, "row bytes")?;
        self.run(
            kernel,
            grid,
            &[
                Buffer(y),
                Buffer(&w.buffer),
                Buffer(quantized),
                U32(n_cols),
                U32(row_bytes),
            ],
        )
    }

    fn rope(
        &self,
        x: &D::Buffer,
        positions: &D::Buffer,
        inv_freqs: &D::Buffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        let kernel = match style {
            RopeStyle::Interleaved => "rope_interleaved_f32",
            RopeStyle::Neox => "rope_neox_f32",
        };
        self.run(
            kernel,
            [blocks(n_tokens * n_heads * head_dim / 2, 256)?, 1, 1],
            &[
                Buffer(x),
                Buffer(positions),
                Buffer(inv_freqs),
                U32(u32_of(n_tokens, "tokens")?),
                U32(u32_of(n_heads, "heads")?),
                U32(u32_of(head_dim, "head_dim")?),
            ],
        )
    }

    fn swiglu(&self, out: &D::Buffer, gate: &D::Buffer, up: &D::Buffer, n: usize) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "swiglu_f32",
            [blocks(n, 256)?, 1, 1],
            &[
                Buffer(out),
                Buffer(gate),
                Buffer(up),
                U32(u32_of(n, "values")?),
            ],
        )
    }

    fn add(&self, x: &D::Buffer, y: &D::Buffer, n: usize) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "add_f32",
            [blocks(n, 256)?, 1, 1],
            &[Buffer(x), Buffer(y), U32(u32_of(n, "values")?)],
        )
    }

    fn add_bias(
        &self,
        x: &D::Buffer,
        bias: &D::Buffer,
        n_rows: usize,
        n_cols: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "add_bias_f32",
            [blocks(n_rows * n_cols, 256)?, 1, 1],
            &[
                Buffer(x),
                Buffer(bias),
                U32(u32_of(n_cols, "columns")?),
                U32(u32_of(n_rows * n_cols, "values")?),
            ],
        )
    }

    fn scale_add_rows(
        &self,
        x: &D::Buffer,
        rows: &D::Buffer,
        ids: &D::Buffer,
        weights: &D::Buffer,
        n_rows: usize,
        dim: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "scale_add_rows_f32",
            [u32_of(n_rows, "rows")?, blocks(dim, 256)?, 1],
            &[
                Buffer(x),
                Buffer(rows),
                Buffer(ids),
                Buffer(weights),
                U32(u32_of(dim, "width")?),
            ],
        )
    }

    fn store_kv(
        &self,
        k_cache: &D::Buffer,
        v_cache: &D::Buffer,
        k: &D::Buffer,
        v: &D::Buffer,
        slots: &D::Buffer,
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "store_kv_f16",
            [
                u32_of(n_tokens, "tokens")?,
                blocks(n_kv_heads * head_dim, 256)?,
                1,
            ],
            &[
                Buffer(k_cache),
                Buffer(v_cache),
                Buffer(k),
                Buffer(v),
                Buffer(slots),
                U32(u32_of(n_kv_heads, "KV heads")?),
                U32(u32_of(head_dim, "head_dim")?),
            ],
        )
    }

    fn read_kv_blocks(
        &self,
        out: &D::Buffer,
        cache: &D::Buffer,
        ids: &D::Buffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()> {
        self.copy_kv_blocks("read_kv_blocks", out, cache, ids, n_ids, block_bytes)
    }

    fn write_kv_blocks(
        &self,
        cache: &D::Buffer,
        rows: &D::Buffer,
        ids: &D::Buffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()> {
        self.copy_kv_blocks("write_kv_blocks", cache, rows, ids, n_ids, block_bytes)
    }

    fn attention(
        &self,
        out: &D::Buffer,
        q: &D::Buffer,
        k_cache: &D::Buffer,
        v_cache: &D::Buffer,
        tables: &D::Buffer,
        table_rows: &D::Buffer,
        context_lens: &D::Buffer,
        shape: &AttentionShape,
    ) -> Result<()> {
        use DeviceArg::{Buffer, F32, U32};
        if shape.head_dim > 128 {
            bail!(
                "the CUDA attention kernel handles heads of up to 128 dimensions, not {}",
                shape.head_dim
            );
        }
        self.run(
            "paged_attention_f16kv",
            [
                u32_of(shape.n_heads, "heads")?,
                u32_of(shape.n_queries, "queries")?,
                1,
            ],
            &[
                Buffer(out),
                Buffer(q),
                Buffer(k_cache),
                Buffer(v_cache),
                Buffer(tables),
                Buffer(table_rows),
                Buffer(context_lens),
                U32(u32_of(shape.max_blocks, "blocks per sequence")?),
                U32(u32_of(shape.n_heads, "heads")?),
                U32(u32_of(shape.n_kv_heads, "KV heads")?),
                U32(u32_of(shape.head_dim, "head_dim")?),
                F32(shape.scale),
            ],
        )
    }

    fn all_reduce_sum_in_place(&self, buffer: &Self::Buffer, n: usize) -> Result<bool> {
        self.device.all_reduce_sum_in_place(buffer, n)
    }

    fn send_to_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        self.device.send_to_stage(buffer, n, stage)
    }

    fn recv_from_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        self.device.recv_from_stage(buffer, n, stage)
    }

    fn argmax(
        &self,
        out: &D::Buffer,
        logits: &D::Buffer,
        n_rows: usize,
        n_vocab: usize,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        self.run(
            "argmax_f32",
            [u32_of(n_rows, "rows")?, 1, 1],
            &[
                Buffer(out),
                Buffer(logits),
                U32(u32_of(n_vocab, "vocabulary")?),
            ],
        )
    }
}

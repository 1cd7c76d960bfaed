//! [`Backend`] over the CUDA kernels ([`super::kernels`]) on any [`Device`] that runs them:
//! a GPU (`super::gpu::GpuRunner`, through cudarc) or the host harness
//! (`super::host::HostKernels`, the same sources on CPU threads). Each op is one or two
//! kernel launches with the grid its source documents; buffers stay on the device
//! between ops, and only what a caller downloads comes back.

use crate::runtime::formats::ggml::GgmlType;
use anyhow::{Result, bail};

use super::kernels::FAMILIES;
use crate::runtime::backend::{AttentionShape, Backend};
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
    /// The buffer (its handle's address) and value count whose Q8_1 blocks the Q8_1 scratch
    /// holds, written by the RMSNorm just launched; any other launch clears it.
    prequantized: std::sync::Mutex<Option<(usize, usize)>>,
}

/// A [`KernelBackend`]'s scratch buffers with their lengths in bytes: `[Q8_1 activations,
/// GEMM weights, GEMM activations, argmax partials]`.
type Scratch<B> = [Option<(B, usize)>; 4];

/// The most tokens a product of unquantized (F32, F16, BF16) weights runs on the
/// matrix-vector kernels when the device has a GEMM: larger batches (prefill) run one GEMM.
/// llama.cpp's CUDA backend draws the same line (`MMVQ_MAX_BATCH_SIZE` = 8,
/// `ggml-cuda/mmvq.cuh`).
pub const MAX_MATVEC_TOKENS: usize = 8;

/// The most tokens a product of quantized weights runs on the matrix-vector kernels when the
/// device has a GEMM. The kernels read each weight once per 8 tokens, so 32 tokens read the
/// weights 4 times (2 GB of Llama-3.1-8B's 4.2 GB of Q4_0 weights a pass); a GEMM first
/// writes them out as f16 (16 GB) and reads them back, which costs more below this.
pub const MAX_MATVEC_TOKENS_QUANTIZED: usize = 32;

/// Tokens one block of a `mul_mat_vec_*_x8` kernel takes (`MMV_TOKENS`,
/// `kernels/matvec.cu`); the plain kernels take one.
const MATVEC_TOKENS_PER_BLOCK: usize = 8;

/// Rows one block of a `mul_mat_vec_*` kernel computes (`MMV_ROWS`, `kernels/matvec.cu`),
/// and of a `mul_mat_vec_*_x8` kernel (`MMV_ROWS_X8`).
const MATVEC_ROWS_PER_BLOCK: (usize, usize) = (4, 2);

/// The fewest tokens that run on the `_x8` kernels: below, one block per token, each
/// reading the weights the first block of its tile brought into L2.
const MATVEC_X8_FROM_TOKENS: usize = 4;

/// What a `mul_mat_vec_*` launch does with its products (`kernels/matvec.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MatVecMode {
    /// `y_m = w_m · x` for each matrix.
    Store = 0,
    /// `y += w · x`.
    Add = 1,
    /// `y = silu(w0 · x) · (w1 · x)`.
    Swiglu = 2,
}

/// GGML's blocks of a Q4_0, Q4_1 or Q8_0 matrix reordered as the CUDA kernels read them
/// (`kernels/matvec.cu`, "Layouts"): every block's quants (16, 16 or 32 bytes), in row-major
/// block order, then every block's scales (the half `d`, or `d` and `m` for Q4_1) in the same
/// order. The same bytes, so the same size. Other types come back as they are.
pub fn split_blocks(ty: GgmlType, bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let (block_bytes, scale_bytes) = match ty {
        GgmlType::Q4_0 => (18, 2),
        GgmlType::Q4_1 => (20, 4),
        GgmlType::Q8_0 => (34, 2),
        _ => return std::borrow::Cow::Borrowed(bytes),
    };
    let n_blocks = bytes.len() / block_bytes;
    let quant_bytes = block_bytes - scale_bytes;
    let mut out = vec![0u8; bytes.len()];
    let (quants, scales) = out.split_at_mut(n_blocks * quant_bytes);
    for ((block, quant), scale) in bytes
        .chunks_exact(block_bytes)
        .zip(quants.chunks_exact_mut(quant_bytes))
        .zip(scales.chunks_exact_mut(scale_bytes))
    {
        scale.copy_from_slice(&block[..scale_bytes]);
        quant.copy_from_slice(&block[scale_bytes..]);
    }
    std::borrow::Cow::Owned(out)
}

/// Bytes of one Q8_1 activation block (32 int8 q, then f32 d and s, held split:
/// `kernels/matvec.cu`).
const Q8_1_BLOCK_BYTES: usize = 40;

/// The widest row `rms_norm_q8_1_f32` takes (`NORM_Q8_1_PASSES` × 1024, `kernels/norm.cu`).
const RMS_NORM_Q8_1_MAX_COLS: usize = 8192;

/// Blocks each row's logits are split over by `argmax_partial_f32` (`ARGMAX_SPLIT`,
/// `kernels/sampling.cu`); each writes one (f32 value, i32 index) partial.
const ARGMAX_SPLIT: usize = 64;

/// A buffer's identity while it lives: the address of its handle.
fn buffer_key<B>(buffer: &B) -> usize {
    buffer as *const B as usize
}

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
            scratch: std::sync::Mutex::new([None, None, None, None]),
            prequantized: std::sync::Mutex::new(None),
        }
    }

    /// The scratch buffers, locked: `[Q8_1 activations, GEMM weights, GEMM activations,
    /// argmax partials]`.
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

    /// What the Q8_1 scratch holds the blocks of, if the last launch put them there
    /// (`rms_norm_q8_1_f32`), clearing it: `(buffer address, values)`.
    fn take_prequantized(&self) -> Option<(usize, usize)> {
        self.prequantized
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
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
        self.take_prequantized();
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

    /// Whether a product of `w` over `n_tokens` runs on the matrix-vector kernels (else one
    /// GEMM): always without a GEMM on the device, else up to [`MAX_MATVEC_TOKENS`] tokens
    /// for unquantized weights and [`MAX_MATVEC_TOKENS_QUANTIZED`] for quantized ones.
    fn on_matvec(&self, w: &DeviceMatrix<D::Buffer>, n_tokens: usize) -> bool {
        let quantized = !matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16);
        self.tokens_on_matvec(n_tokens, quantized)
    }

    /// [`Self::on_matvec`] for any matrix of quantized (or unquantized) weights.
    fn tokens_on_matvec(&self, n_tokens: usize, quantized: bool) -> bool {
        let limit = if quantized {
            MAX_MATVEC_TOKENS_QUANTIZED
        } else {
            MAX_MATVEC_TOKENS
        };
        n_tokens <= limit || !self.device.has_gemm()
    }

    /// Records that the Q8_1 scratch now holds the blocks of `y`'s first `n_values` values
    /// (written by the launch just made), for the next product that reads `y`.
    fn mark_prequantized(&self, y: &D::Buffer, n_values: usize) {
        *self.prequantized.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((buffer_key(y), n_values));
    }

    /// One `mul_mat_vec_*` launch: up to three products of the same activations `x`
    /// `(n_tokens, n_cols)` f32 with matrices of one type and width, each into its own `y`
    /// (`(n_tokens, n_rows)` f32), as `mode` says (for [`MatVecMode::Swiglu`], the gate and
    /// the up projection with the one output). Quantized weights take `x` quantized to Q8_1
    /// first, in the scratch every product reuses.
    ///
    /// Errors: no product, more than three, or of mixed types or widths; a type without a
    /// kernel, unquantized rows that are not a multiple of 8 values; the device's.
    fn mat_vec(
        &self,
        products: &[(&D::Buffer, &DeviceMatrix<D::Buffer>)],
        x: &D::Buffer,
        n_tokens: usize,
        mode: MatVecMode,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        let Some(&(_, first)) = products.first() else {
            bail!("a matrix-vector launch without a product");
        };
        if products.len() > 3
            || products
                .iter()
                .any(|(_, w)| (w.ty, w.n_cols) != (first.ty, first.n_cols))
        {
            bail!(
                "one matrix-vector launch takes up to three matrices of one type and width, given {}",
                products.len()
            );
        }
        // (one token a block, 8 tokens a block, whether the activations are quantized)
        let (kernel, kernel_x8, quantized) = match first.ty {
            GgmlType::F32 => ("mul_mat_vec_f32", "mul_mat_vec_f32_x8", false),
            GgmlType::F16 => ("mul_mat_vec_f16", "mul_mat_vec_f16_x8", false),
            GgmlType::Bf16 => ("mul_mat_vec_bf16", "mul_mat_vec_bf16_x8", false),
            GgmlType::Q4_0 => ("mul_mat_vec_q4_0_q8_1", "mul_mat_vec_q4_0_q8_1_x8", true),
            GgmlType::Q4_1 => ("mul_mat_vec_q4_1_q8_1", "mul_mat_vec_q4_1_q8_1_x8", true),
            GgmlType::Q8_0 => ("mul_mat_vec_q8_0_q8_1", "mul_mat_vec_q8_0_q8_1_x8", true),
            GgmlType::Q4K => ("mul_mat_vec_q4_k_q8_1", "mul_mat_vec_q4_k_q8_1_x8", true),
            GgmlType::Q6K => ("mul_mat_vec_q6_k_q8_1", "mul_mat_vec_q6_k_q8_1_x8", true),
            other => bail!(
                "the CUDA backend has no matrix-vector kernel for {other:?} weights (it runs F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K)"
            ),
        };
        if !quantized && !first.n_cols.is_multiple_of(8) {
            bail!(
                "the CUDA backend's products of {:?} weights need rows of a multiple of 8 values, not {}",
                first.ty,
                first.n_cols
            );
        }
        let n_cols = u32_of(first.n_cols, "columns")?;
        let ready = self.take_prequantized() == Some((buffer_key(x), n_tokens * first.n_cols));
        let mut scratch = self.scratch();
        let [q8_1_scratch, _, _, _] = &mut *scratch;
        let activations = if quantized && ready {
            // The RMSNorm just launched wrote `x`'s blocks.
            self.scratch_of(
                q8_1_scratch,
                n_tokens * first.n_cols / 32 * Q8_1_BLOCK_BYTES,
            )?
        } else if quantized {
            // The activations as Q8_1 blocks, in the scratch every product reuses.
            let n_blocks = n_tokens * first.n_cols / 32;
            let quantized = self.scratch_of(q8_1_scratch, n_blocks * Q8_1_BLOCK_BYTES)?;
            self.run(
                "quantize_q8_1",
                [u32_of(n_blocks, "blocks")?, 1, 1],
                &[
                    Buffer(quantized),
                    Buffer(x),
                    U32(u32_of(n_tokens * first.n_cols, "values")?),
                ],
            )?;
            quantized
        } else {
            x
        };
        let x8 = n_tokens >= MATVEC_X8_FROM_TOKENS;
        let (rows_per_tile, token_groups) = if x8 {
            (
                MATVEC_ROWS_PER_BLOCK.1,
                n_tokens.div_ceil(MATVEC_TOKENS_PER_BLOCK),
            )
        } else {
            (MATVEC_ROWS_PER_BLOCK.0, n_tokens)
        };
        let tiles = match mode {
            MatVecMode::Swiglu => {
                let [(_, gate), (_, up)] = products else {
                    bail!("a fused SwiGLU takes the gate and the up projection");
                };
                if gate.n_rows != up.n_rows {
                    bail!(
                        "a fused SwiGLU of {} gate rows and {} up rows",
                        gate.n_rows,
                        up.n_rows
                    );
                }
                gate.n_rows.div_ceil(rows_per_tile / 2)
            }
            MatVecMode::Store | MatVecMode::Add => products
                .iter()
                .map(|(_, w)| w.n_rows.div_ceil(rows_per_tile))
                .sum(),
        };
        let mut args = Vec::with_capacity(13);
        for m in 0..3 {
            match products.get(m) {
                Some((y, w)) => args.extend([
                    Buffer(*y),
                    Buffer(&w.buffer),
                    U32(u32_of(w.n_rows, "rows")?),
                ]),
                // No matrix: its row count 0 keeps every block off it.
                None => args.extend([Buffer(products[0].0), Buffer(&first.buffer), U32(0)]),
            }
        }
        args.extend([
            Buffer(activations),
            U32(n_cols),
            U32(u32_of(n_tokens, "tokens")?),
            U32(mode as u32),
        ]);
        let kernel = if x8 { kernel_x8 } else { kernel };
        self.run(
            kernel,
            [u32_of(tiles * token_groups, "blocks")?, 1, 1],
            &args,
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
        let [_, weights_scratch, activations_scratch, _] = &mut *scratch;
        let expanded = match dequantize {
            Some(kernel) => {
                let out = self.scratch_of(weights_scratch, w.n_rows * w.n_cols * 2)?;
                let n_rows = u32_of(w.n_rows, "rows")?;
                self.run(
                    kernel,
                    [n_rows, blocks(w.n_cols, 256)?, 1],
                    &[Buffer(out), Buffer(&w.buffer), U32(n_rows), U32(n_cols)],
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
        self.take_prequantized();
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

    fn matrix_shape(&self, w: &Self::Matrix) -> (usize, usize) {
        (w.n_rows, w.n_cols)
    }

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
            buffer: self.device.upload(&split_blocks(ty, bytes))?,
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
        let (kernel, n_args) = match table.ty {
            GgmlType::F32 => ("get_rows_f32", 4),
            GgmlType::Q8_0 => ("get_rows_q8_0", 5),
            other => bail!(
                "the CUDA backend looks up embeddings in F32 or Q8_0 tables, not {other:?} (dequantize the table to F32 when uploading it)"
            ),
        };
        use DeviceArg::{Buffer, U32};
        let args = [
            Buffer(out),
            Buffer(&table.buffer),
            Buffer(ids),
            U32(u32_of(table.n_cols, "columns")?),
            U32(u32_of(table.n_rows, "rows")?),
        ];
        self.run(
            kernel,
            [u32_of(n_ids, "rows")?, blocks(table.n_cols, 256)?, 1],
            &args[..n_args],
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
        if n_cols.is_multiple_of(32) && n_cols <= RMS_NORM_Q8_1_MAX_COLS {
            // Its Q8_1 blocks too, for the quantized products that read `y` next.
            let mut scratch = self.scratch();
            let [q8_1_scratch, _, _, _] = &mut *scratch;
            let quantized =
                self.scratch_of(q8_1_scratch, n_rows * n_cols / 32 * Q8_1_BLOCK_BYTES)?;
            self.run(
                "rms_norm_q8_1_f32",
                [u32_of(n_rows, "rows")?, 1, 1],
                &[
                    Buffer(y),
                    Buffer(quantized),
                    Buffer(x),
                    Buffer(weight),
                    U32(u32_of(n_cols, "columns")?),
                    F32(eps),
                ],
            )?;
            self.mark_prequantized(y, n_rows * n_cols);
            return Ok(());
        }
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
        if !self.on_matvec(w, n_tokens) {
            return self.matmul_gemm(y, w, x, n_tokens);
        }
        self.mat_vec(&[(y, w)], x, n_tokens, MatVecMode::Store)
    }

    fn matmul_many(
        &self,
        products: &[(&D::Buffer, &Self::Matrix)],
        x: &D::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        let shared = products.len() <= 3
            && products.iter().all(|(_, w)| {
                self.on_matvec(w, n_tokens)
                    && w.ty == products[0].1.ty
                    && w.n_cols == products[0].1.n_cols
            });
        if !shared {
            for (y, w) in products {
                self.matmul(y, w, x, n_tokens)?;
            }
            return Ok(());
        }
        self.mat_vec(products, x, n_tokens, MatVecMode::Store)
    }

    fn matmul_add(
        &self,
        residual: &D::Buffer,
        scratch: &D::Buffer,
        w: &Self::Matrix,
        x: &D::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        if !self.on_matvec(w, n_tokens) {
            self.matmul_gemm(scratch, w, x, n_tokens)?;
            return self.add(residual, scratch, n_tokens * w.n_rows);
        }
        self.mat_vec(&[(residual, w)], x, n_tokens, MatVecMode::Add)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_swiglu(
        &self,
        out: &D::Buffer,
        gate_scratch: &D::Buffer,
        up_scratch: &D::Buffer,
        gate: &Self::Matrix,
        up: &Self::Matrix,
        x: &D::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        let fused = self.on_matvec(gate, n_tokens)
            && self.on_matvec(up, n_tokens)
            && (gate.ty, gate.n_rows, gate.n_cols) == (up.ty, up.n_rows, up.n_cols);
        if !fused {
            self.matmul(gate_scratch, gate, x, n_tokens)?;
            self.matmul(up_scratch, up, x, n_tokens)?;
            return self.swiglu(out, gate_scratch, up_scratch, n_tokens * gate.n_rows);
        }
        self.mat_vec(&[(out, gate), (out, up)], x, n_tokens, MatVecMode::Swiglu)
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

    fn rope_store_kv(
        &self,
        (q, k, v): (&D::Buffer, &D::Buffer, &D::Buffer),
        (k_cache, v_cache): (&D::Buffer, &D::Buffer),
        positions: &D::Buffer,
        inv_freqs: &D::Buffer,
        slots: &D::Buffer,
        shape: &AttentionShape,
        style: RopeStyle,
    ) -> Result<()> {
        use DeviceArg::{Buffer, U32};
        let pairs = (shape.n_heads + shape.n_kv_heads) * shape.head_dim / 2;
        self.run(
            "rope_store_kv_f16",
            [u32_of(shape.n_queries, "tokens")?, blocks(pairs, 256)?, 1],
            &[
                Buffer(q),
                Buffer(k),
                Buffer(v),
                Buffer(k_cache),
                Buffer(v_cache),
                Buffer(positions),
                Buffer(inv_freqs),
                Buffer(slots),
                U32(u32_of(shape.n_heads, "heads")?),
                U32(u32_of(shape.n_kv_heads, "KV heads")?),
                U32(u32_of(shape.head_dim, "head_dim")?),
                U32(u32::from(style == RopeStyle::Neox)),
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
        if shape.head_dim > 128 || !shape.head_dim.is_multiple_of(8) {
            bail!(
                "the CUDA attention kernel handles heads of a multiple of 8 dimensions up to 128, not {}",
                shape.head_dim
            );
        }
        // Its Q8_1 blocks too when the output projection will read them (as RMSNorm's):
        // a batch small enough for the matrix-vector kernels, whole blocks in each head.
        let n_values = shape.n_queries * shape.n_heads * shape.head_dim;
        let quantize =
            shape.head_dim.is_multiple_of(32) && self.tokens_on_matvec(shape.n_queries, true);
        let mut scratch = self.scratch();
        let [q8_1_scratch, _, _, _] = &mut *scratch;
        let quantized = self.scratch_of(
            q8_1_scratch,
            if quantize {
                n_values / 32 * Q8_1_BLOCK_BYTES
            } else {
                Q8_1_BLOCK_BYTES
            },
        )?;
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
                Buffer(quantized),
                U32(u32::from(quantize)),
            ],
        )?;
        if quantize {
            self.mark_prequantized(out, n_values);
        }
        Ok(())
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
        let rows = u32_of(n_rows, "rows")?;
        let mut scratch = self.scratch();
        let [_, _, _, partials_scratch] = &mut *scratch;
        let partials = self.scratch_of(partials_scratch, n_rows * ARGMAX_SPLIT * 8)?;
        self.run(
            "argmax_partial_f32",
            [rows, ARGMAX_SPLIT as u32, 1],
            &[
                Buffer(partials),
                Buffer(logits),
                U32(u32_of(n_vocab, "vocabulary")?),
            ],
        )?;
        self.run(
            "argmax_combine_f32",
            [rows, 1, 1],
            &[Buffer(out), Buffer(partials)],
        )
    }
}

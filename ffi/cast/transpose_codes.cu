// One-byte codes transposed: [R, C] -> [C, R], 1 byte read and 1 written per code. Per-tensor
// FP8's columnwise usage is its rowwise codes transposed (one scale for the whole tensor), so
// a tensor whose rowwise codes exist (written by the op that made the tensor, or gathered
// over the network) gets its columnwise codes here without reading its high-precision values
// again: 2 bytes moved per element, where a cast of both usages from bf16 moves 4.
//
// A CTA transposes a 128 x 64 tile through shared memory: it reads 16-byte row vectors (two
// full 32-byte sectors per row of the tile) and each thread writes 32 contiguous bytes of an
// output row, so both sides move whole sectors.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"

namespace jaxquant {
namespace {

constexpr int kTileRows = 128;  // input rows per tile: 128 contiguous bytes of an output row
constexpr int kTileCols = 64;   // input columns per tile: output rows
constexpr int kTransposeThreads = 256;
constexpr int kVector = 16;  // bytes per load / store

// Loads: kTileRows rows of kTileCols / kVector vectors; stores: kTileCols rows of
// kTileRows / (2 kVector) 32-byte pairs. Both are whole multiples of the block.
static_assert(kTileRows * kTileCols / kVector % kTransposeThreads == 0, "load split");
static_assert(kTileCols * (kTileRows / (2 * kVector)) == kTransposeThreads, "store split");

// Four codes of column c from rows r .. r+3 of the tile, packed little-endian (row r first).
__device__ __forceinline__ uint32_t column_word(const uint8_t (*tile)[kTileCols], int r, int c) {
  return static_cast<uint32_t>(tile[r][c]) | static_cast<uint32_t>(tile[r + 1][c]) << 8 |
         static_cast<uint32_t>(tile[r + 2][c]) << 16 | static_cast<uint32_t>(tile[r + 3][c]) << 24;
}

// rows and cols are multiples of kVector (checked by the handler), so a vector is either
// wholly inside the matrix or wholly outside it, and every vector address is aligned.
__global__ __launch_bounds__(kTransposeThreads) void transpose_codes_kernel(
    const uint8_t* __restrict__ in, int64_t rows, int64_t cols, uint8_t* __restrict__ out) {
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileCols];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  constexpr int kRowVectors = kTileCols / kVector;
#pragma unroll
  for (int i = 0; i < kTileRows * kRowVectors / kTransposeThreads; ++i) {
    const int v = threadIdx.x + i * kTransposeThreads;
    const int r = v / kRowVectors, q = v % kRowVectors;
    const int64_t gr = r0 + r, gc = c0 + q * kVector;
    uint4 codes = make_uint4(0, 0, 0, 0);
    if (gr < rows && gc < cols) codes = *reinterpret_cast<const uint4*>(in + gr * cols + gc);
    *reinterpret_cast<uint4*>(&tile[r][q * kVector]) = codes;
  }
  __syncthreads();
  // Consecutive threads take consecutive output rows (tile columns): a warp's shared-memory
  // reads are 32 consecutive bytes of one tile row, free of bank conflicts.
  const int c = threadIdx.x % kTileCols;
  const int r = (threadIdx.x / kTileCols) * 2 * kVector;
  const int64_t gc = c0 + c, gr = r0 + r;
  if (gc >= cols) return;
  uint8_t* dst = out + gc * rows + gr;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (gr + half * kVector >= rows) break;
    const int base = r + half * kVector;
    *reinterpret_cast<uint4*>(dst + half * kVector) =
        make_uint4(column_word(tile, base, c), column_word(tile, base + 4, c),
                   column_word(tile, base + 8, c), column_word(tile, base + 12, c));
  }
}

ffi::Error transpose_codes(cudaStream_t stream, ffi::AnyBuffer in,
                           ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = in.dimensions();
  if (dims.size() != 2) return invalid("transpose_codes: expects a [R, C] matrix");
  if (ffi::ByteWidth(in.element_type()) != 1) {
    return invalid("transpose_codes: expects one-byte codes");
  }
  const int64_t rows = dims[0], cols = dims[1];
  if (rows % kVector || cols % kVector) {
    return invalid("transpose_codes: R and C must be multiples of 16");
  }
  const auto out_dims = out->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != cols || out_dims[1] != rows) {
    return invalid("transpose_codes: the result must be [C, R]");
  }
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const dim3 grid((cols + kTileCols - 1) / kTileCols, (rows + kTileRows - 1) / kTileRows);
  if (grid.y > 65535) return invalid("transpose_codes: R is too large for one launch");
  transpose_codes_kernel<<<grid, kTransposeThreads, 0, stream>>>(
      static_cast<const uint8_t*>(in.untyped_data()), rows, cols,
      static_cast<uint8_t*>(out->untyped_data()));
  return cuda_status("transpose_codes");
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantTransposeCodes, jaxquant::transpose_codes,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()  // codes [R, C]
                            .Ret<xla::ffi::AnyBuffer>());  // codes [C, R]

// jax_flashattn.pack_mask's CUDA kernel (cuda/packed_mask/pack_mask.cu) checked from C++, without
// JAX: its bits and tile summaries against the CPU packer's (cuda/cpu/pack_mask.cc), bit for bit,
// on odd sizes, broadcast row and key axes, rows that are not 16-byte aligned and masks holding bytes
// other than 0 and 1, and the Hopper backward's bits by key made from them
// (cuda/sm90/bwd_mask_columns.h) against the mask; nothing may be written past any output.
// `--bench` also times the packing kernel and the transposer.
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icuda/include -Icuda tests/cuda/pack_mask_check.cu \
//        cuda/packed_mask/pack_mask.cu cuda/cpu/pack_mask.cc cuda/cpu/parallel_for.cc -o /tmp/pack_mask_check
//   /tmp/pack_mask_check [--bench] [seed]
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "check_util.h"  // CK
#include "cpu/pack_mask.h"
#include "packed_mask/pack_mask.h"
#include "sm90/bwd_mask_columns.h"

namespace {

using jfa::BooleanMask;

// What the mask holds: random elements (some as bytes 7, not 1), the causal triangle, tiles that
// are empty, full or random in turn (every summary kind), or everything.
enum class Pattern { kRandom, kCausal, kTiles, kAll };

struct Case {
  int64_t slices, T, S;
  bool rows_broadcast, keys_broadcast;  // a [.., 1, S] or [.., T, 1] mask (stride 0)
  int offset;                           // bytes before the mask in its buffer: 16-byte aligned or not
  Pattern pattern;
};

uint8_t element(Pattern pattern, int64_t slice, int64_t i, int64_t j, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.f, 1.f);
  const int64_t tile = i / jfa::kMaskTileRows + j / jfa::kMaskChunkKeys;
  switch (pattern) {
    case Pattern::kRandom: return u(rng) < 0.5f ? (j % 3 == 0 ? 7 : 1) : 0;
    case Pattern::kCausal: return j <= i;
    case Pattern::kTiles: return (tile + slice) % 3 == 0 ? 1 : (tile + slice) % 3 == 1 ? 0 : u(rng) < 0.5f;
    case Pattern::kAll: return 1;
  }
  return 0;
}

// A [slices, T, S] boolean mask laid out densely (no broadcast axis) at `data`.
BooleanMask dense_mask(int64_t slices, int64_t T, int64_t S, const uint8_t* data) {
  BooleanMask m;
  m.slices = slices;
  m.T = T;
  m.S = S;
  m.slice_stride = T * S;
  m.row_stride = S;
  m.key_stride = 1;
  m.data = data;
  return m;
}

// The parameters the transposer reads (sm90/bwd_mask_columns.h): packed bits and tile summaries
// of `slices` mask slices (as batches, one head) and the workspace for the bits by key.
jfa::AttentionParams transpose_params(int64_t slices, int64_t T, int64_t S, const uint32_t* bits,
                                      const uint8_t* tiles, uint32_t* key_bits) {
  jfa::AttentionParams p;
  p.B = slices;
  p.N = 1;
  p.T = T;
  p.S = S;
  jfa::PackedMaskView& view = p.mask.packed_mask;
  view.bits = bits;
  view.words = jfa::mask_words(S);
  view.bits_batch_stride = slices > 1 ? T * view.words : 0;
  view.tiles = tiles;  // the transposer takes whole-tile blocks from their summaries
  view.chunks = jfa::mask_chunks(S);
  view.row_blocks = jfa::mask_row_blocks(T);
  view.tiles_batch_stride = slices > 1 ? view.row_blocks * view.chunks : 0;
  p.mask_key_bits = key_bits;
  return p;
}

// The bits by key that the Hopper backward makes from `device_bits` (sm90/bwd_mask_columns.h)
// against the mask itself: key j's row holds query i at bit 2·(i % 128 / 8) + i % 2 of word
// 4·(i / 128) + (i % 8) / 2, zero past T and S; nothing may be written past the workspace. Without
// every_block, a block of 128 keys by 128 queries that the mask leaves empty may stay unwritten (the
// backward skips its steps); every other block must be exact.
int check_key_bits(const Case& c, const uint8_t* mask, const uint32_t* device_bits, const uint8_t* device_tiles,
                   bool every_block) {
  const int64_t rows = jfa::mask_chunks(c.S) * jfa::kMaskChunkKeys, words = jfa::mask_words(c.T);
  const size_t n = size_t(c.slices * rows * words);
  uint32_t* key_bits;
  CK(cudaMalloc(&key_bits, (n + 1) * 4));
  CK(cudaMemset(key_bits, 0xAB, (n + 1) * 4));
  jfa::AttentionParams p = transpose_params(c.slices, c.T, c.S, device_bits, device_tiles, key_bits);
  CK(jfa::sm90::transpose_mask_bits(p, every_block, 0));
  CK(cudaDeviceSynchronize());
  std::vector<uint32_t> got(n + 1);
  CK(cudaMemcpy(got.data(), key_bits, (n + 1) * 4, cudaMemcpyDeviceToHost));
  CK(cudaFree(key_bits));
  const int64_t mask_rows = c.rows_broadcast ? 1 : c.T, mask_keys = c.keys_broadcast ? 1 : c.S;
  auto want = [&](int64_t s, int64_t i, int64_t j) {
    return i < c.T && j < c.S &&
           mask[(s * mask_rows + (c.rows_broadcast ? 0 : i)) * mask_keys + (c.keys_broadcast ? 0 : j)] != 0;
  };
  const int64_t blocks = words / jfa::kMaskChunkWords;
  std::vector<char> block_set(size_t(c.slices * (rows / jfa::kMaskChunkKeys) * blocks), 0);
  auto set_of = [&](int64_t s, int64_t j, int64_t i) -> char& {
    return block_set[size_t((s * (rows / jfa::kMaskChunkKeys) + j / jfa::kMaskChunkKeys) * blocks +
                            i / jfa::kMaskChunkKeys)];
  };
  for (int64_t s = 0; s < c.slices; ++s)
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t i = 0; i < words * 32; ++i)
        if (want(s, i, j)) set_of(s, j, i) = 1;
  int bad = 0;
  for (int64_t s = 0; s < c.slices; ++s)
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t i = 0; i < words * 32; ++i) {
        if (!every_block && !set_of(s, j, i)) continue;
        const int64_t x = i % jfa::kMaskChunkKeys;
        const uint32_t word = got[size_t((s * rows + j) * words + 4 * (i / jfa::kMaskChunkKeys) + (x % 8) / 2)];
        const bool bit = (word >> (2 * (x / 8) + x % 2)) & 1u;
        if (bit != want(s, i, j) && bad++ < 5)
          std::printf("  key bits (every block %d): slice %lld key %lld query %lld: %d, the mask's %d\n",
                      int(every_block), (long long)s, (long long)j, (long long)i, int(bit), int(want(s, i, j)));
      }
  if (got[n] != 0xABABABABu) {
    std::printf("  key bits: wrote past the end\n");
    ++bad;
  }
  return bad;
}

// Packs the case's mask on the GPU and compares; returns the number of mismatches.
int check(const Case& c, std::mt19937& rng) {
  const int64_t mask_rows = c.rows_broadcast ? 1 : c.T, mask_keys = c.keys_broadcast ? 1 : c.S;
  std::vector<uint8_t> host(c.offset + c.slices * mask_rows * mask_keys);
  for (int64_t s = 0; s < c.slices; ++s)
    for (int64_t i = 0; i < mask_rows; ++i)
      for (int64_t j = 0; j < mask_keys; ++j)
        host[c.offset + (s * mask_rows + i) * mask_keys + j] = element(c.pattern, s, i, j, rng);
  BooleanMask m;
  m.slices = c.slices;
  m.T = c.T;
  m.S = c.S;
  m.slice_stride = mask_rows * mask_keys;
  m.row_stride = c.rows_broadcast ? 0 : mask_keys;
  m.key_stride = c.keys_broadcast ? 0 : 1;
  m.data = host.data() + c.offset;
  std::vector<uint32_t> want_bits(m.slices * m.T * jfa::mask_words(m.S));
  std::vector<uint8_t> want_tiles(m.slices * jfa::mask_row_blocks(m.T) * jfa::mask_chunks(m.S));
  jfa::cpu::pack_mask(m, want_bits.data(), want_tiles.data());

  // One guard element past each output, which the kernel must leave alone.
  uint8_t* device_mask;
  uint32_t* bits;
  uint8_t* tiles;
  const size_t nb = want_bits.size(), nt = want_tiles.size();
  CK(cudaMalloc(&device_mask, host.size()));
  CK(cudaMemcpy(device_mask, host.data(), host.size(), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&bits, (nb + 1) * 4));
  CK(cudaMalloc(&tiles, nt + 1));
  CK(cudaMemset(bits, 0xAB, (nb + 1) * 4));
  CK(cudaMemset(tiles, 0xCD, nt + 1));
  m.data = device_mask + c.offset;
  CK(jfa::gpu::pack_mask(m, bits, tiles, 0));
  CK(cudaDeviceSynchronize());
  int bad = check_key_bits(c, host.data() + c.offset, bits, tiles, /*every_block=*/true) +
            check_key_bits(c, host.data() + c.offset, bits, tiles, /*every_block=*/false);
  std::vector<uint32_t> got_bits(nb + 1);
  std::vector<uint8_t> got_tiles(nt + 1);
  CK(cudaMemcpy(got_bits.data(), bits, (nb + 1) * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_tiles.data(), tiles, nt + 1, cudaMemcpyDeviceToHost));
  CK(cudaFree(device_mask));
  CK(cudaFree(bits));
  CK(cudaFree(tiles));

  for (size_t k = 0; k < nb; ++k)
    if (got_bits[k] != want_bits[k] && bad++ < 5)
      std::printf("  word %zu: %08x, the host packer's %08x\n", k, got_bits[k], want_bits[k]);
  for (size_t t = 0; t < nt; ++t)
    if (got_tiles[t] != want_tiles[t] && bad++ < 10)
      std::printf("  summary %zu: %d, the host packer's %d\n", t, got_tiles[t], want_tiles[t]);
  if (got_bits[nb] != 0xABABABABu || got_tiles[nt] != 0xCD) {
    std::printf("  wrote past the end\n");
    ++bad;
  }
  std::printf("%s slices %lld T %lld S %lld rows broadcast %d keys broadcast %d offset %d pattern %d\n",
              bad ? "FAIL" : "ok  ", (long long)c.slices, (long long)c.T, (long long)c.S, c.rows_broadcast,
              c.keys_broadcast, c.offset, int(c.pattern));
  return bad;
}

// A mask of random bytes 0 and 1 (every tile partial): element k's from a hash of k.
__global__ void fill_random_mask(uint8_t* mask, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(k) * 0x9E3779B9u ^ uint32_t(k >> 32);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    mask[k] = uint8_t(h & 1u);
  }
}

// The Hopper backward's transposer (sm90/bwd_mask_columns.h) on a packed random mask (every block
// transposed) and on an all-true one (every block from its summaries): three rounds, each the
// mean of 20 back-to-back launches after 3 untimed ones.
void bench_transpose(int64_t slices, int64_t T, int64_t S) {
  uint8_t *device_mask, *tiles;
  uint32_t *bits, *key_bits;
  const int64_t key_words = slices * jfa::mask_chunks(S) * jfa::kMaskChunkKeys * jfa::mask_words(T);
  CK(cudaMalloc(&device_mask, slices * T * S));
  CK(cudaMalloc(&bits, slices * T * jfa::mask_words(S) * 4));
  CK(cudaMalloc(&tiles, slices * jfa::mask_row_blocks(T) * jfa::mask_chunks(S)));
  CK(cudaMalloc(&key_bits, key_words * 4));
  const BooleanMask m = dense_mask(slices, T, S, device_mask);
  jfa::AttentionParams p = transpose_params(slices, T, S, bits, tiles, key_bits);
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (const char* pattern : {"random", "all"}) {
    if (pattern[0] == 'r')
      fill_random_mask<<<1024, 256>>>(device_mask, slices * T * S);
    else
      CK(cudaMemset(device_mask, 1, slices * T * S));
    CK(jfa::gpu::pack_mask(m, bits, tiles, 0));
    for (int round = 0; round < 3; ++round) {
      constexpr int kLaunches = 20;
      for (int i = 0; i < 3; ++i) CK(jfa::sm90::transpose_mask_bits(p, false, 0));
      CK(cudaEventRecord(start));
      for (int i = 0; i < kLaunches; ++i) CK(jfa::sm90::transpose_mask_bits(p, false, 0));
      CK(cudaEventRecord(stop));
      CK(cudaEventSynchronize(stop));
      float ms;
      CK(cudaEventElapsedTime(&ms, start, stop));
      ms /= kLaunches;
      std::printf("bench transpose %s slices %lld T %lld S %lld round %d %.4f ms (%.0f GB/s of bits written)\n",
                  pattern, (long long)slices, (long long)T, (long long)S, round, ms,
                  double(key_words) * 4 / 1e9 / (ms * 1e-3));
    }
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaFree(device_mask));
  CK(cudaFree(bits));
  CK(cudaFree(tiles));
  CK(cudaFree(key_bits));
}

// Three rounds, each the mean of 20 back-to-back launches after 3 untimed ones.
void bench(int64_t slices, int64_t T, int64_t S) {
  uint8_t* device_mask;
  uint32_t* bits;
  uint8_t* tiles;
  CK(cudaMalloc(&device_mask, slices * T * S));
  CK(cudaMemset(device_mask, 1, slices * T * S));
  CK(cudaMalloc(&bits, slices * T * jfa::mask_words(S) * 4));
  CK(cudaMalloc(&tiles, slices * jfa::mask_row_blocks(T) * jfa::mask_chunks(S)));
  const BooleanMask m = dense_mask(slices, T, S, device_mask);
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (int round = 0; round < 3; ++round) {
    constexpr int kLaunches = 20;
    for (int i = 0; i < 3; ++i) CK(jfa::gpu::pack_mask(m, bits, tiles, 0));
    CK(cudaEventRecord(start));
    for (int i = 0; i < kLaunches; ++i) CK(jfa::gpu::pack_mask(m, bits, tiles, 0));
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms;
    CK(cudaEventElapsedTime(&ms, start, stop));
    ms /= kLaunches;
    std::printf("bench slices %lld T %lld S %lld round %d %.4f ms (%.0f GB/s of mask read)\n", (long long)slices,
                (long long)T, (long long)S, round, ms, double(slices * T * S) / 1e9 / (ms * 1e-3));
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaFree(device_mask));
  CK(cudaFree(bits));
  CK(cudaFree(tiles));
}

}  // namespace

int main(int argc, char** argv) {
  const bool bench_too = argc > 1 && std::string(argv[1]) == "--bench";
  const int seed_at = bench_too ? 2 : 1;
  const unsigned seed = argc > seed_at ? unsigned(std::strtoul(argv[seed_at], nullptr, 10)) : std::random_device{}();
  std::printf("seed: %u\n", seed);
  std::mt19937 rng(seed);
  using P = Pattern;
  const Case cases[] = {
      {1, 1, 1, false, false, 0, P::kRandom},       {1, 3, 127, false, false, 0, P::kRandom},
      {1, 64, 128, false, false, 0, P::kRandom},    {1, 65, 129, false, false, 0, P::kRandom},
      {6, 70, 300, false, false, 0, P::kRandom},    {2, 130, 1040, false, false, 0, P::kRandom},
      {3, 200, 640, false, false, 0, P::kTiles},    {1, 257, 1024, false, false, 0, P::kCausal},
      {2, 129, 512, false, false, 0, P::kAll},      {2, 100, 1040, true, false, 0, P::kRandom},
      {2, 100, 700, false, true, 0, P::kRandom},    {1, 64, 1024, false, false, 1, P::kRandom},
      {1, 64, 1024, false, false, 8, P::kRandom},   {5, 1, 5, false, false, 0, P::kRandom},
      {1, 1000, 2000, false, false, 0, P::kTiles},  {2, 64, 16, false, false, 0, P::kRandom},
      {1, 77, 4112, false, false, 0, P::kRandom},   {1, 130, 384, true, false, 16, P::kCausal},
      {66000, 3, 5, false, false, 0, P::kRandom},  // more slices than a grid's y or z holds
  };
  int failures = 0;
  for (const Case& c : cases) failures += check(c, rng) != 0;
  std::printf("%d failures\n", failures);
  if (bench_too) {
    bench(1, 2048, 2048);
    bench(8, 2048, 2048);  // the Flax training step's [B, 1, T, T] mask
    bench(4, 4096, 4096);
    bench(1, 16384, 16384);
    bench_transpose(1, 16384, 16384);
    bench_transpose(16, 4096, 4096);  // a mask per head
  }
  return failures != 0;
}

// Environment configuration of the GTBM allocators (see config.h).
#include "config.h"

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../gtbm/gtbm_core.h"

namespace dymem {
namespace {
// A pool holds at least this many pageblocks: each mobility group reserves whole blocks and keeps one partly used,
// so a block is a share of the budget no plan can use. 256 keeps that share at 0.4% or less; every device of
// 512 MiB or more keeps the 2 MiB block.
constexpr uint64_t kMinBlocksPerLimit = 256;
}  // namespace

uint64_t PhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return kDefaultMaxLimit;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

uint64_t BytesFromEnv(const char* name, uint64_t fallback, bool allow_zero) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  uint64_t bytes = 0;
  std::string error;
  if (!gtbm::ParseBytes(value, &bytes, &error) || (bytes == 0 && !allow_zero)) {
    std::fprintf(stderr, "dymem_tf GTBM: ignoring %s: %s; using %llu bytes\n", name,
                 error.empty() ? "must be positive" : error.c_str(), static_cast<unsigned long long>(fallback));
    return fallback;
  }
  return bytes;
}

bool FlagFromEnv(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(v == "0" || v == "false" || v == "off" || v == "no");
}

uint64_t BlockSizeFor(uint64_t limit) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t auto_block = kDefaultBlockSize;
  while (auto_block > page && auto_block * kMinBlocksPerLimit > limit) auto_block /= 2;
  const uint64_t block = BytesFromEnv(kBlockSizeEnv, auto_block);
  if (block % page == 0 && (block & (block - 1)) == 0) return block;
  std::fprintf(stderr, "dymem_tf GTBM: %s must be a power-of-two multiple of the page size (%llu); using %llu\n",
               kBlockSizeEnv, static_cast<unsigned long long>(page), static_cast<unsigned long long>(auto_block));
  return auto_block;
}

}  // namespace dymem

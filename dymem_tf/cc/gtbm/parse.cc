// Names of the groups and policies, and ParseBytes (see gtbm_core.h).
#include <string>
#include <string_view>

#include "arith.h"
#include "gtbm_core.h"

namespace gtbm {

namespace {

// ASCII lower case of `c`.
char Lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

// ASCII case-insensitive equality.
bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (Lower(a[i]) != Lower(b[i])) return false;
  }
  return true;
}

}  // namespace

const char* GroupName(int group) {
  switch (group) {
    case kPersistent:
      return "persistent";
    case kTransient:
      return "transient";
    case kMobile:
      return "mobile";
    default:
      return "invalid";
  }
}

bool ParseGroup(std::string_view text, int* group) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) text.remove_suffix(1);
  for (int g = 0; g < kNumGroups; ++g) {
    if (EqualsIgnoreCase(text, GroupName(g)) || (text.size() == 1 && text[0] == static_cast<char>('0' + g))) {
      *group = g;
      return true;
    }
  }
  return false;
}

const char* PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kGtbm:
      return "gtbm";
    case Policy::kGtbmNoGroups:
      return "gtbm_nogroups";
    case Policy::kBestFit:
      return "best_fit";
    case Policy::kFirstFit:
      return "first_fit";
  }
  return "invalid";
}

bool ParsePolicy(std::string_view text, Policy* policy) {
  for (int p = 0; p < kNumPolicies; ++p) {
    if (EqualsIgnoreCase(text, PolicyName(static_cast<Policy>(p)))) {
      *policy = static_cast<Policy>(p);
      return true;
    }
  }
  return false;
}

bool ParseBytes(std::string_view text, uint64_t* bytes, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error != nullptr) *error = "invalid byte count '" + std::string(text) + "': " + why;
    return false;
  };
  std::string_view s = text;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  if (s.empty()) return fail("empty");
  if (s.front() == '-') return fail("negative");
  if (s.front() == '+') s.remove_prefix(1);
  // Integer part and optional fraction, kept exact as digits.
  uint64_t integer = 0;
  size_t i = 0;
  size_t int_digits = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (integer > (kMaxBytes - d) / 10) return fail("too large");
    integer = integer * 10 + d;
    ++i;
    ++int_digits;
  }
  std::string frac;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') frac.push_back(s[i++]);
    if (frac.size() > 18) frac.resize(18);  // beyond 1e-18 of a unit nothing changes at byte granularity
  }
  if (int_digits == 0 && frac.empty()) return fail("expected a number, e.g. 512MiB, 2GB or 1073741824");
  while (i < s.size() && s[i] == ' ') ++i;
  const std::string_view unit = s.substr(i);
  struct Unit {
    const char* name;
    uint64_t mult;
  };
  static const Unit kUnits[] = {
      {"", 1},
      {"b", 1},
      {"k", uint64_t{1} << 10},
      {"kib", uint64_t{1} << 10},
      {"kb", 1000},
      {"m", uint64_t{1} << 20},
      {"mib", uint64_t{1} << 20},
      {"mb", 1000 * 1000},
      {"g", uint64_t{1} << 30},
      {"gib", uint64_t{1} << 30},
      {"gb", uint64_t{1000} * 1000 * 1000},
      {"t", uint64_t{1} << 40},
      {"tib", uint64_t{1} << 40},
      {"tb", uint64_t{1000} * 1000 * 1000 * 1000},
  };
  uint64_t mult = 0;
  for (const Unit& u : kUnits) {
    if (EqualsIgnoreCase(unit, u.name)) mult = u.mult;
  }
  if (mult == 0) return fail("unknown unit '" + std::string(unit) + "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
  if (integer != 0 && mult > kMaxBytes / integer) return fail("too large");
  uint64_t total = integer * mult;
  // Fraction: floor(0.frac * mult), computed exactly digit by digit on the remainder.
  uint64_t rem_num = 0;
  if (!frac.empty()) {
    // floor(0.frac * mult) exactly: num / 10^k * mult with 128-bit intermediates (num < 10^18, mult <= 2^40).
    unsigned __int128 num = 0;
    unsigned __int128 den = 1;
    for (char c : frac) {
      num = num * 10 + static_cast<unsigned>(c - '0');
      den *= 10;
    }
    const unsigned __int128 part = num * mult / den;
    rem_num = static_cast<uint64_t>(part);
  }
  if (rem_num > kMaxBytes - total) return fail("too large");
  total += rem_num;
  *bytes = total;
  return true;
}

}  // namespace gtbm

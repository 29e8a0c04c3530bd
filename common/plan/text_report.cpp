#include "plan/text_report.h"

#include <algorithm>
#include <cstdio>

namespace pd::plan {

std::string fmt_fixed(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

std::string fmt_sig(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// "42.95 GB (40.00 GiB)": GB = 10^9 bytes, GiB = 2^30.
std::string fmt_bytes(double b) {
  char buf[96];
  if (b >= 1e12) {
    std::snprintf(buf, sizeof buf, "%.3f TB (%.1f GiB)", b / 1e12, b / 1073741824.0);
  } else if (b >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB (%.2f GiB)", b / 1e9, b / 1073741824.0);
  } else if (b >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2f MB (%.2f MiB)", b / 1e6, b / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f B (%.1f KiB)", b, b / 1024.0);
  }
  return buf;
}

std::string fmt_time(double s) {
  char buf[64];
  if (s >= 1) {
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f us", s * 1e6);
  }
  return buf;
}

std::string fmt_count(double v) {
  char buf[64];
  if (v >= 1e15) {
    std::snprintf(buf, sizeof buf, "%.3g P", v / 1e15);
  } else if (v >= 1e12) {
    std::snprintf(buf, sizeof buf, "%.3g T", v / 1e12);
  } else if (v >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.3g G", v / 1e9);
  } else if (v >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.3g M", v / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.4g", v);
  }
  return buf;
}

TextTable::TextTable(std::vector<std::string> header) { rows_.push_back(std::move(header)); }

void TextTable::add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

void TextTable::print(std::ostream& os) const {
  std::vector<size_t> w(rows_[0].size(), 0);
  for (const auto& r : rows_) {
    for (size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], r[i].size());
  }
  for (size_t k = 0; k < rows_.size(); ++k) {
    const auto& r = rows_[k];
    std::string line;
    for (size_t i = 0; i < w.size(); ++i) {
      const std::string cell = i < r.size() ? r[i] : "";
      const std::string pad(w[i] - cell.size(), ' ');
      line += (i == 0 ? cell + pad : "  " + pad + cell);
    }
    os << line << "\n";
    if (k == 0) {
      size_t total = 0;
      for (size_t x : w) total += x + 2;
      os << std::string(total - 2, '-') << "\n";
    }
  }
}

}  // namespace pd::plan

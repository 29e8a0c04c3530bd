// Plain-text formatting for the planner's human-readable reports: numbers with
// units and a column-aligned table. Output only; no parsing.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace pd::plan {

std::string fmt_fixed(double v, int decimals = 3);  // "%.*f"
std::string fmt_sig(double v);                      // 4 significant digits, "%.4g"
// Bytes in decimal and binary units: "42.95 GB (40.00 GiB)", "1.374 TB (1280.0 GiB)".
std::string fmt_bytes(double bytes);
// Seconds scaled to s, ms or us: "12.846 ms".
std::string fmt_time(double seconds);
// A count with an SI prefix: "1.38 T", "33.6 M".
std::string fmt_count(double v);

// Rows of cells printed under a header and a rule; the first column is
// left-aligned, the others right-aligned; columns as wide as their widest cell.
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header);
  void add(std::vector<std::string> row);
  void print(std::ostream& os) const;

 private:
  std::vector<std::vector<std::string>> rows_;  // rows_[0] is the header
};

}  // namespace pd::plan

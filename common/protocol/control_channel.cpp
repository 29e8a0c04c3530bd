#include "protocol/control_channel.h"

namespace pd {

void LoadReporter::maybe_send(ControlChannel& ch, int router, const proto::LoadReport& r, bool force,
                              std::chrono::steady_clock::time_point now) {
  const bool changed = r.waiting != last_report_.waiting || r.running != last_report_.running ||
                       r.free_blocks != last_report_.free_blocks || r.preemptions != last_report_.preemptions ||
                       r.ready != last_report_.ready || r.epoch != last_report_.epoch ||
                       r.quarantined_blocks != last_report_.quarantined_blocks;
  const auto since = now - last_;
  if (!force && !(changed && since >= std::chrono::milliseconds(20)) && since < std::chrono::seconds(1)) return;
  ch.send(router, r);
  last_ = now;
  last_report_ = r;
}

}  // namespace pd

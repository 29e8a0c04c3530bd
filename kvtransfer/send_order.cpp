#include "kvtransfer/send_order.h"

namespace pd {

size_t next_send(std::span<const WaitingSend> waiting, const SendOrderPolicy& policy) {
  for (size_t i = 0; i < waiting.size(); ++i)
    if (waiting[i].bypassed_bytes > policy.max_bypass_bytes) return i;
  for (size_t i = 0; i < waiting.size(); ++i)
    if (waiting[i].urgency == SendUrgency::kDecodeWaiting) return i;
  return 0;
}

}  // namespace pd

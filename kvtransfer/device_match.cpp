#include "kvtransfer/device_match.h"

#include <algorithm>
#include <string>

namespace pd {
namespace {

// Little-endian fixed fields.
class Writer {
 public:
  explicit Writer(size_t reserve) { out_.reserve(reserve); }
  void u8(uint8_t v) { out_.push_back(v); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  template <size_t N>
  void bytes(const std::array<uint8_t, N>& a) {
    out_.insert(out_.end(), a.begin(), a.end());
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  uint32_t u32() { return static_cast<uint32_t>(get(4)); }
  uint64_t u64() { return get(8); }
  template <size_t N>
  void bytes(std::array<uint8_t, N>& a) {
    std::copy_n(in_.begin() + static_cast<std::ptrdiff_t>(pos_), N, a.begin());
    pos_ += N;
  }
  size_t left() const { return in_.size() - pos_; }

 private:
  uint64_t get(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 1;  // after the kind byte
};

// Bytes of each kind's fixed part (kind byte included).
constexpr size_t kDescriptorFixed = 1 + 4 + 8 + 64 + 8 + 4;
constexpr size_t kAckSize = 1 + 4 + 8;
constexpr size_t kIdSize = 1 + 128;
constexpr size_t kEnvelopeSize = 1 + 4 + 8;

Status wrong_size(const char* kind, size_t got, size_t need) {
  return Status::corruption(std::string("device KV message: ") + kind + " of " + std::to_string(got) +
                            " bytes, expected " + std::to_string(need));
}

}  // namespace

size_t serialized_size(const DeviceMsg& m) {
  if (const auto* d = std::get_if<IpcDescriptor>(&m)) return kDescriptorFixed + 8 * d->offsets.size();
  if (std::holds_alternative<DeviceAck>(m)) return kAckSize;
  if (std::holds_alternative<NcclIdMsg>(m)) return kIdSize;
  return kEnvelopeSize;
}

std::vector<uint8_t> serialize_device_msg(const DeviceMsg& m) {
  Writer w(serialized_size(m));
  if (const auto* d = std::get_if<IpcDescriptor>(&m)) {
    w.u8(static_cast<uint8_t>(DeviceMsgKind::kIpcDescriptor));
    w.u32(static_cast<uint32_t>(d->tag));
    w.u64(d->seq);
    w.bytes(d->handle);
    w.u64(static_cast<uint64_t>(d->piece_bytes));
    w.u32(static_cast<uint32_t>(d->offsets.size()));
    for (int64_t o : d->offsets) w.u64(static_cast<uint64_t>(o));
  } else if (const auto* a = std::get_if<DeviceAck>(&m)) {
    w.u8(static_cast<uint8_t>(DeviceMsgKind::kAck));
    w.u32(static_cast<uint32_t>(a->tag));
    w.u64(a->seq);
  } else if (const auto* id = std::get_if<NcclIdMsg>(&m)) {
    w.u8(static_cast<uint8_t>(DeviceMsgKind::kNcclId));
    w.bytes(id->id);
  } else {
    const auto& e = std::get<NcclEnvelope>(m);
    w.u8(static_cast<uint8_t>(DeviceMsgKind::kNcclEnvelope));
    w.u32(static_cast<uint32_t>(e.tag));
    w.u64(e.bytes);
  }
  return w.take();
}

Result<DeviceMsg> deserialize_device_msg(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return Status::corruption("device KV message: empty");
  Reader r(bytes);
  switch (static_cast<DeviceMsgKind>(bytes[0])) {
    case DeviceMsgKind::kIpcDescriptor: {
      if (bytes.size() < kDescriptorFixed) return wrong_size("IPC descriptor", bytes.size(), kDescriptorFixed);
      IpcDescriptor d;
      d.tag = static_cast<int32_t>(r.u32());
      d.seq = r.u64();
      r.bytes(d.handle);
      d.piece_bytes = static_cast<int64_t>(r.u64());
      const uint32_t n = r.u32();
      const size_t need = kDescriptorFixed + 8 * static_cast<size_t>(n);
      if (bytes.size() != need) return wrong_size("IPC descriptor", bytes.size(), need);
      if (d.piece_bytes <= 0 || n == 0)
        return Status::corruption("device KV message: IPC descriptor of an empty region (" + std::to_string(n) +
                                  " pieces of " + std::to_string(d.piece_bytes) + " bytes)");
      d.offsets.resize(n);
      for (int64_t& o : d.offsets) o = static_cast<int64_t>(r.u64());
      return DeviceMsg{std::move(d)};
    }
    case DeviceMsgKind::kAck: {
      if (bytes.size() != kAckSize) return wrong_size("ack", bytes.size(), kAckSize);
      DeviceAck a;
      a.tag = static_cast<int32_t>(r.u32());
      a.seq = r.u64();
      return DeviceMsg{a};
    }
    case DeviceMsgKind::kNcclId: {
      if (bytes.size() != kIdSize) return wrong_size("NCCL id", bytes.size(), kIdSize);
      NcclIdMsg m;
      r.bytes(m.id);
      return DeviceMsg{m};
    }
    case DeviceMsgKind::kNcclEnvelope: {
      if (bytes.size() != kEnvelopeSize) return wrong_size("NCCL envelope", bytes.size(), kEnvelopeSize);
      NcclEnvelope e;
      e.tag = static_cast<int32_t>(r.u32());
      e.bytes = r.u64();
      return DeviceMsg{e};
    }
  }
  return Status::corruption("device KV message: unknown kind " + std::to_string(bytes[0]));
}

DeviceMsgLink::~DeviceMsgLink() {
  for (Outgoing& o : outgoing_) {
    int done = 0;
    if (MPI_Test(&o.req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) continue;
    if (o.req != MPI_REQUEST_NULL) MPI_Request_free(&o.req);
    (void)o.bytes.release();
  }
}

Status DeviceMsgLink::send(int peer, const DeviceMsg& m) {
  const auto ep = links_->endpoint(peer);
  if (!ep) return Status::not_found("device transport: no link to rank " + std::to_string(peer));
  Outgoing o{std::make_unique<std::vector<uint8_t>>(serialize_device_msg(m)), MPI_REQUEST_NULL};
  if (MPI_Isend(o.bytes->data(), static_cast<int>(o.bytes->size()), MPI_BYTE, ep->rank, tag_, ep->comm, &o.req) !=
      MPI_SUCCESS)
    return Status::io_error("device transport: MPI_Isend to rank " + std::to_string(peer) + " failed");
  outgoing_.push_back(std::move(o));
  return Status::ok();
}

std::vector<DeviceMsgLink::Arrived> DeviceMsgLink::poll() {
  std::vector<Arrived> arrived;
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    int done = 0;
    const int rc = MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
    it = (rc != MPI_SUCCESS || done) ? outgoing_.erase(it) : std::next(it);
  }
  for (const MpiLinks::Link& link : links_->links()) {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, tag_, link.comm, &flag, &st) != MPI_SUCCESS || !flag) break;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      recv_buf_.resize(static_cast<size_t>(std::max(count, 1)));
      if (MPI_Recv(recv_buf_.data(), count, MPI_BYTE, st.MPI_SOURCE, tag_, link.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        break;
      const int peer = link.id == -1 ? links_->world_id(st.MPI_SOURCE) : link.id;
      arrived.push_back(
          Arrived{peer, deserialize_device_msg(std::span<const uint8_t>(recv_buf_.data(), static_cast<size_t>(count)))});
    }
  }
  return arrived;
}

int DeviceMsgLink::self_id() const {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  return links_->world_id(world_rank);
}

int64_t DeviceOpTable::add(bool send, int peer, int tag) {
  const int64_t id = next_++;
  ops_.emplace(id, Op{send, peer, tag, DevicePhase::kQueued, Status::ok()});
  if (!send) queued_recvs_[{peer, tag}].push_back(id);
  return id;
}

std::optional<int64_t> DeviceOpTable::match(int peer, int tag) {
  auto q = queued_recvs_.find({peer, tag});
  if (q == queued_recvs_.end()) return std::nullopt;
  const int64_t id = q->second.front();  // queues are never left empty
  q->second.pop_front();
  if (q->second.empty()) queued_recvs_.erase(q);
  ops_.at(id).phase = DevicePhase::kInFlight;
  return id;
}

void DeviceOpTable::unqueue(int64_t id, const Op& op) {
  if (op.send || op.phase != DevicePhase::kQueued) return;
  auto q = queued_recvs_.find({op.peer, op.tag});
  if (q == queued_recvs_.end()) return;
  q->second.erase(std::remove(q->second.begin(), q->second.end(), id), q->second.end());
  if (q->second.empty()) queued_recvs_.erase(q);
}

bool DeviceOpTable::start(int64_t id) {
  auto it = ops_.find(id);
  if (it == ops_.end() || !it->second.send || it->second.phase != DevicePhase::kQueued) return false;
  it->second.phase = DevicePhase::kInFlight;
  return true;
}

void DeviceOpTable::finish(int64_t id) {
  auto it = ops_.find(id);
  if (it != ops_.end() && it->second.phase == DevicePhase::kInFlight) it->second.phase = DevicePhase::kDone;
}

void DeviceOpTable::fail(int64_t id, Status why) {
  auto it = ops_.find(id);
  if (it == ops_.end()) return;
  Op& op = it->second;
  if (op.phase != DevicePhase::kQueued && op.phase != DevicePhase::kInFlight) return;
  unqueue(id, op);
  op.phase = DevicePhase::kFailed;
  op.error = std::move(why);
}

bool DeviceOpTable::cancel(int64_t id) {
  auto it = ops_.find(id);
  if (it == ops_.end() || it->second.phase != DevicePhase::kQueued) return false;
  unqueue(id, it->second);
  it->second.phase = DevicePhase::kCancelled;
  return true;
}

std::optional<DevicePhase> DeviceOpTable::abandon(int64_t id) {
  auto it = ops_.find(id);
  if (it == ops_.end()) return std::nullopt;
  const DevicePhase phase = it->second.phase;
  unqueue(id, it->second);
  ops_.erase(it);
  return phase;
}

Result<OpState> DeviceOpTable::report(int64_t id) {
  auto it = ops_.find(id);
  if (it == ops_.end()) return Status::not_found("device transport: unknown transfer op " + std::to_string(id));
  const DevicePhase phase = it->second.phase;
  if (phase == DevicePhase::kQueued || phase == DevicePhase::kInFlight) return OpState::kPending;
  Status error = std::move(it->second.error);
  ops_.erase(it);
  if (phase == DevicePhase::kFailed) return error;
  return phase == DevicePhase::kDone ? OpState::kDone : OpState::kCancelled;
}

const DeviceOpTable::Op* DeviceOpTable::find(int64_t id) const {
  auto it = ops_.find(id);
  return it == ops_.end() ? nullptr : &it->second;
}

std::vector<int64_t> DeviceOpTable::live_ops_with(int peer) const {
  std::vector<int64_t> ids;
  for (const auto& [id, op] : ops_)
    if (op.peer == peer && (op.phase == DevicePhase::kQueued || op.phase == DevicePhase::kInFlight)) ids.push_back(id);
  return ids;
}

}  // namespace pd

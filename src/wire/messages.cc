#include "wire/messages.h"

#include <algorithm>
#include <cstdio>

#include "common/crc32c.h"

namespace hxfer::wire {
namespace {

// Status codes on the wire: 0..9, and Expired (11) from minor 2 on. PermissionDenied (10)
// never travels: transports refuse an unauthenticated peer before any message is exchanged,
// and the engine answers identity problems with Incompatible.
constexpr uint8_t kMaxStatusCode = static_cast<uint8_t>(StatusCode::kExpired);

bool statusCodeOnWire(int code, uint16_t minor) {
  if (code < 0 || code > kMaxStatusCode) return false;
  if (code == static_cast<int>(StatusCode::kPermissionDenied)) return false;
  return code != static_cast<int>(StatusCode::kExpired) || minor >= 2;
}

std::string versionText(uint16_t major, uint16_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

Status over(const std::string& field, uint64_t value, uint64_t limit) {
  return Corruption(field + "=" + std::to_string(value) + " exceeds the limit " +
                    std::to_string(limit));
}

// ---- encoding -------------------------------------------------------------------------------

void encodeStatus(const Status& s, Bytes& out) {
  putFixed8(out, static_cast<uint8_t>(s.code()));
  putString(out, s.message());
}

void encodeBody(const Hello& m, Bytes& out) {
  Bytes info = encodeRankInfo(m.rank_info);
  putBytes(out, info);
  putString(out, m.auth_token);
  putFixed64(out, m.incarnation);
}

void encodeBody(const TransferRequest& m, Bytes& out) {
  putFixed64(out, m.request_id);
  putVarint64(out, m.gen_tp_rank);
  putVarint64(out, m.gen_pp_rank);
  putVarint64(out, m.dst_block_ids.size());
  for (uint32_t id : m.dst_block_ids) putVarint64(out, id);
  putFixed8(out, m.dst_slot.has_value() ? 1 : 0);
  if (m.dst_slot) putVarint64(out, *m.dst_slot);
  putVarint64(out, m.first_block);
  putVarint64(out, m.num_tokens);
  putBytes(out, m.aux);
  putVarint64(out, m.epoch);
  putFixed8(out, m.staging.has_value() ? 1 : 0);
  if (m.staging) {
    putVarint64(out, m.staging->region);
    putVarint64(out, m.staging->offset);
    putVarint64(out, m.staging->bytes);
  }
  putVarint64(out, m.dst_group_slots.size());
  for (uint32_t id : m.dst_group_slots) putVarint64(out, id);
  putVarint64(out, m.staging ? m.staging->part : 0);
  putVarint64(out, m.staging ? m.staging->window : 0);
}

void encodeBody(const TransferDone& m, Bytes& out) {
  putFixed64(out, m.request_id);
  encodeStatus(m.status, out);
  putVarint64(out, m.bytes);
  putFixed8(out, m.checksum.has_value() ? 1 : 0);
  if (m.checksum) putFixed64(out, *m.checksum);
  putBytes(out, m.aux);
  putVarint64(out, m.epoch);
}

void encodeBody(const Cancel& m, Bytes& out) {
  putFixed64(out, m.request_id);
  putString(out, m.reason);
  putVarint64(out, m.epoch);
}

void encodeBody(const Error& m, Bytes& out) { encodeStatus(m.status, out); }

// ---- checks shared by checkMessage and the decoder ------------------------------------------

Status checkStatus(const Status& s, const std::string& path, bool allow_ok) {
  if (!statusCodeOnWire(static_cast<int>(s.code()), kWireVersionMinor)) {
    return Corruption(path + "code: status code " + std::to_string(static_cast<int>(s.code())) +
                      " (" + std::string(statusCodeName(s.code())) + ") does not travel");
  }
  if (!allow_ok && s.isOk()) return Corruption(path + "code: 0 (ok) is not an error");
  if (s.message().size() > kMaxMessageBytes) {
    return over(path + "message.length", s.message().size(), kMaxMessageBytes);
  }
  return OkStatus();
}

Status check(const Hello& m) {
  if (m.auth_token.size() > kMaxTokenBytes) {
    return over("hello.auth_token.length", m.auth_token.size(), kMaxTokenBytes);
  }
  Status s = checkRankInfo(m.rank_info);
  if (!s.isOk()) return Status(s.code(), "hello." + s.message());
  return OkStatus();
}

Status check(const TransferRequest& m) {
  if (m.gen_tp_rank >= kMaxTp)
    return over("transfer_request.gen_tp_rank", m.gen_tp_rank, kMaxTp - 1);
  if (m.gen_pp_rank >= kMaxPp)
    return over("transfer_request.gen_pp_rank", m.gen_pp_rank, kMaxPp - 1);
  if (m.dst_block_ids.size() > kMaxBlockIds) {
    return over("transfer_request.dst_block_ids.count", m.dst_block_ids.size(), kMaxBlockIds);
  }
  if (m.first_block > m.dst_block_ids.size()) {
    return Corruption("transfer_request.first_block=" + std::to_string(m.first_block) +
                      " is past the " + std::to_string(m.dst_block_ids.size()) +
                      " destination blocks");
  }
  if (m.num_tokens > kMaxTokens)
    return over("transfer_request.num_tokens", m.num_tokens, kMaxTokens);
  if (m.aux.size() > kMaxAuxBytes)
    return over("transfer_request.aux.length", m.aux.size(), kMaxAuxBytes);
  if (m.staging) {
    if (m.staging->offset > kMaxRegionBytes)
      return over("transfer_request.staging.offset", m.staging->offset, kMaxRegionBytes);
    if (m.staging->bytes > kMaxRegionBytes)
      return over("transfer_request.staging.bytes", m.staging->bytes, kMaxRegionBytes);
    if (m.staging->part > kMaxRegionBytes)
      return over("transfer_request.staging_part", m.staging->part, kMaxRegionBytes);
    if (m.staging->window > kMaxRegionBytes)
      return over("transfer_request.staging_window", m.staging->window, kMaxRegionBytes);
    if (m.staging->part == 0 && m.staging->window != 0) {
      return Corruption("transfer_request.staging_window=" + std::to_string(m.staging->window) +
                        " but staging_part is 0 (the whole part)");
    }
  }
  if (m.dst_group_slots.size() > kMaxStateGroups) {
    return over("transfer_request.dst_group_slots.count", m.dst_group_slots.size(),
                kMaxStateGroups);
  }
  if (!m.dst_group_slots.empty() && !m.dst_slot) {
    return Corruption("transfer_request.dst_group_slots has " +
                      std::to_string(m.dst_group_slots.size()) + " ids but dst_slot is absent");
  }
  return OkStatus();
}

Status check(const TransferDone& m) {
  if (m.aux.size() > kMaxAuxBytes) {
    return over("transfer_done.aux.length", m.aux.size(), kMaxAuxBytes);
  }
  return checkStatus(m.status, "transfer_done.status.", /*allow_ok=*/true);
}

Status check(const Cancel& m) {
  if (m.reason.size() > kMaxMessageBytes) {
    return over("cancel.reason.length", m.reason.size(), kMaxMessageBytes);
  }
  return OkStatus();
}

Status check(const Error& m) { return checkStatus(m.status, "error.status.", /*allow_ok=*/false); }

// ---- decoding -------------------------------------------------------------------------------

Status readStatus(WireReader& r, bool allow_ok, uint16_t minor, Status* out) {
  auto scope = r.scope("status.");
  uint8_t code = 0;
  RETURN_IF_ERROR(r.enumByte("code", kMaxStatusCode, &code));
  if (!statusCodeOnWire(code, minor)) {
    return r.corrupt("code", std::to_string(code) + " (" +
                                 std::string(statusCodeName(static_cast<StatusCode>(code))) +
                                 ") does not travel in a frame of minor " + std::to_string(minor));
  }
  if (!allow_ok && code == 0) return r.corrupt("code", "0 (ok) is not an error");
  std::string message;
  RETURN_IF_ERROR(r.string("message", kMaxMessageBytes, &message));
  *out = Status(static_cast<StatusCode>(code), std::move(message));
  return OkStatus();
}

// `minor`: the frame's. Fields appended by a minor this frame predates stay at their defaults.
Status readBody(WireReader& r, Hello* m, uint16_t minor) {
  std::span<const uint8_t> info;
  RETURN_IF_ERROR(r.span("rank_info", kMaxFrameBodyBytes, &info));
  ASSIGN_OR_RETURN(m->rank_info, internal::decodeRankInfo(info, r.name("rank_info.")));
  RETURN_IF_ERROR(r.string("auth_token", kMaxTokenBytes, &m->auth_token));
  if (minor < 2) return OkStatus();
  return r.u64Fixed("incarnation", &m->incarnation);
}

// transfer_request.epoch was appended in minor 2, staging in minor 4, dst_group_slots in 5,
// staging_part and staging_window in 7.
Status readBody(WireReader& r, TransferRequest* m, uint16_t minor) {
  RETURN_IF_ERROR(r.u64Fixed("request_id", &m->request_id));
  RETURN_IF_ERROR(r.varint32("gen_tp_rank", kMaxTp - 1, &m->gen_tp_rank));
  RETURN_IF_ERROR(r.varint32("gen_pp_rank", kMaxPp - 1, &m->gen_pp_rank));
  size_t n = 0;
  RETURN_IF_ERROR(r.count("dst_block_ids.count", kMaxBlockIds, 1, &n));
  m->dst_block_ids.resize(n);
  for (size_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(r.varint32("dst_block_ids", UINT32_MAX, &m->dst_block_ids[i]));
  }
  bool has_slot = false;
  RETURN_IF_ERROR(r.boolean("has_dst_slot", &has_slot));
  if (has_slot) {
    uint32_t slot = 0;
    RETURN_IF_ERROR(r.varint32("dst_slot", UINT32_MAX, &slot));
    m->dst_slot = slot;
  }
  RETURN_IF_ERROR(r.varint32("first_block", n, &m->first_block));
  RETURN_IF_ERROR(r.varint("num_tokens", kMaxTokens, &m->num_tokens));
  RETURN_IF_ERROR(r.bytes("aux", kMaxAuxBytes, &m->aux));
  if (minor < 2) return OkStatus();
  RETURN_IF_ERROR(r.varint("epoch", UINT64_MAX, &m->epoch));
  if (minor < kStagingMinor) return OkStatus();
  bool has_staging = false;
  RETURN_IF_ERROR(r.boolean("has_staging", &has_staging));
  if (has_staging) {
    Staging st;
    RETURN_IF_ERROR(r.varint32("staging.region", UINT32_MAX, &st.region));
    RETURN_IF_ERROR(r.varint("staging.offset", kMaxRegionBytes, &st.offset));
    RETURN_IF_ERROR(r.varint("staging.bytes", kMaxRegionBytes, &st.bytes));
    m->staging = st;
  }
  if (minor < kStateGroupsMinor) return OkStatus();
  RETURN_IF_ERROR(r.count("dst_group_slots.count", kMaxStateGroups, 1, &n));
  if (n > 0 && !has_slot) {
    return Corruption(r.name("dst_group_slots.count") + "=" + std::to_string(n) +
                      " but dst_slot is absent");
  }
  m->dst_group_slots.resize(n);
  for (size_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(r.varint32("dst_group_slots", UINT32_MAX, &m->dst_group_slots[i]));
  }
  if (minor < kStagingWindowMinor) return OkStatus();
  uint64_t part = 0, window = 0;
  RETURN_IF_ERROR(r.varint("staging_part", kMaxRegionBytes, &part));
  RETURN_IF_ERROR(r.varint("staging_window", kMaxRegionBytes, &window));
  if ((part != 0 || window != 0) && !has_staging) {
    return Corruption(r.name(part != 0 ? "staging_part" : "staging_window") + "=" +
                      std::to_string(part != 0 ? part : window) + " but has_staging is 0");
  }
  if (part == 0 && window != 0) {
    return Corruption(r.name("staging_window") + "=" + std::to_string(window) +
                      " but staging_part is 0 (the whole part)");
  }
  if (m->staging) {
    m->staging->part = part;
    m->staging->window = window;
  }
  return OkStatus();
}

// transfer_done.aux was appended in minor 1, transfer_done.epoch in minor 2.
Status readBody(WireReader& r, TransferDone* m, uint16_t minor) {
  RETURN_IF_ERROR(r.u64Fixed("request_id", &m->request_id));
  RETURN_IF_ERROR(readStatus(r, /*allow_ok=*/true, minor, &m->status));
  RETURN_IF_ERROR(r.varint("bytes", UINT64_MAX, &m->bytes));
  bool has_checksum = false;
  RETURN_IF_ERROR(r.boolean("has_checksum", &has_checksum));
  if (has_checksum) {
    uint64_t c = 0;
    RETURN_IF_ERROR(r.u64Fixed("checksum", &c));
    m->checksum = c;
  }
  if (minor < 1) return OkStatus();
  RETURN_IF_ERROR(r.bytes("aux", kMaxAuxBytes, &m->aux));
  if (minor < 2) return OkStatus();
  return r.varint("epoch", UINT64_MAX, &m->epoch);
}

Status readBody(WireReader& r, Cancel* m, uint16_t minor) {
  RETURN_IF_ERROR(r.u64Fixed("request_id", &m->request_id));
  RETURN_IF_ERROR(r.string("reason", kMaxMessageBytes, &m->reason));
  if (minor < 2) return OkStatus();
  return r.varint("epoch", UINT64_MAX, &m->epoch);
}

Status readBody(WireReader& r, Error* m, uint16_t minor) {
  return readStatus(r, /*allow_ok=*/false, minor, &m->status);
}

template <typename T>
StatusOr<Message> decodeBody(std::span<const uint8_t> body, std::string path, uint16_t minor) {
  WireReader r(body, std::move(path));
  T m;
  RETURN_IF_ERROR(readBody(r, &m, minor));
  // Fields a newer minor appended are skipped; otherwise the body must end here.
  if (minor <= kWireVersionMinor) RETURN_IF_ERROR(r.expectEnd("end"));
  RETURN_IF_ERROR(check(m));
  return Message(std::move(m));
}

// Header fields, in the order a reader can check them.
struct Header {
  uint16_t major = 0, minor = 0;
  uint8_t type = 0;
  uint32_t body_length = 0;
};

StatusOr<Header> readHeader(std::span<const uint8_t> in) {
  if (in.size() < 4) {
    return Corruption("frame.magic: truncated (" + std::to_string(in.size()) +
                      " bytes, a frame header has " + std::to_string(kFrameHeaderBytes) + ")");
  }
  const uint32_t magic = loadFixed32(in.data());
  if (magic != kFrameMagic) {
    char got[16];
    std::snprintf(got, sizeof(got), "0x%08x", magic);
    return Corruption(std::string("frame.magic: ") + got + " is not \"hxfr\" (0x72667868)");
  }
  Header h;
  if (in.size() < 8) {
    return Corruption("frame.version: truncated (" + std::to_string(in.size()) + " bytes)");
  }
  h.major = static_cast<uint16_t>(in[4] | in[5] << 8);
  h.minor = static_cast<uint16_t>(in[6] | in[7] << 8);
  if (h.major != kWireVersionMajor) {
    return Incompatible("frame.version: peer speaks " + versionText(h.major, h.minor) +
                        ", this build speaks " + versionText(kWireVersionMajor, kWireVersionMinor) +
                        " (major versions differ)");
  }
  if (in.size() < kFrameHeaderBytes) {
    return Corruption("frame.body_length: truncated header (" + std::to_string(in.size()) + " of " +
                      std::to_string(kFrameHeaderBytes) + " bytes)");
  }
  h.type = in[8];
  h.body_length = loadFixed32(in.data() + 9);
  if (h.body_length > kMaxFrameBodyBytes) {
    return over("frame.body_length", h.body_length, kMaxFrameBodyBytes);
  }
  return h;
}

}  // namespace

std::string_view messageTypeName(MessageType t) {
  switch (t) {
    case MessageType::kHello:
      return "hello";
    case MessageType::kTransferRequest:
      return "transfer_request";
    case MessageType::kTransferDone:
      return "transfer_done";
    case MessageType::kCancel:
      return "cancel";
    case MessageType::kError:
      return "error";
  }
  return "unknown";
}

MessageType messageType(const Message& m) {
  // Variant alternatives are in MessageType order, starting at 1.
  return static_cast<MessageType>(m.index() + 1);
}

Status checkMessage(const Message& m) {
  return std::visit([](const auto& v) { return check(v); }, m);
}

Bytes encodeMessage(const Message& m) {
  Bytes out;
  putFixed32(out, kFrameMagic);
  putFixed16(out, kWireVersionMajor);
  putFixed16(out, kWireVersionMinor);
  putFixed8(out, static_cast<uint8_t>(messageType(m)));
  putFixed32(out, 0);  // body length, patched below
  std::visit([&](const auto& v) { encodeBody(v, out); }, m);
  storeFixed32(out.data() + 9, static_cast<uint32_t>(out.size() - kFrameHeaderBytes));
  putFixed32(out, crc32c(out.data(), out.size()));
  return out;
}

StatusOr<size_t> frameLength(std::span<const uint8_t> header) {
  ASSIGN_OR_RETURN(Header h, readHeader(header));
  return kFrameHeaderBytes + size_t{h.body_length} + kFrameTrailerBytes;
}

StatusOr<Message> decodeMessage(std::span<const uint8_t> frame, uint16_t* frame_minor) {
  ASSIGN_OR_RETURN(Header h, readHeader(frame));
  const size_t total = kFrameHeaderBytes + size_t{h.body_length} + kFrameTrailerBytes;
  if (frame.size() < total) {
    return Corruption("frame: truncated: body_length=" + std::to_string(h.body_length) + " needs " +
                      std::to_string(total) + " bytes, have " + std::to_string(frame.size()));
  }
  if (frame.size() > total) {
    return Corruption("frame: " + std::to_string(frame.size() - total) +
                      " trailing bytes after the frame's " + std::to_string(total));
  }
  const uint32_t stored = loadFixed32(frame.data() + total - kFrameTrailerBytes);
  const uint32_t computed = crc32c(frame.data(), total - kFrameTrailerBytes);
  if (stored != computed) {
    char text[80];
    std::snprintf(text, sizeof(text), "frame.crc32c: stored 0x%08x, computed 0x%08x", stored,
                  computed);
    return Corruption(text);
  }
  const auto body = frame.subspan(kFrameHeaderBytes, h.body_length);
  const uint16_t minor = h.minor;
  StatusOr<Message> m = Corruption("frame.type");
  switch (static_cast<MessageType>(h.type)) {
    case MessageType::kHello:
      m = decodeBody<Hello>(body, "hello.", minor);
      break;
    case MessageType::kTransferRequest:
      m = decodeBody<TransferRequest>(body, "transfer_request.", minor);
      break;
    case MessageType::kTransferDone:
      m = decodeBody<TransferDone>(body, "transfer_done.", minor);
      break;
    case MessageType::kCancel:
      m = decodeBody<Cancel>(body, "cancel.", minor);
      break;
    case MessageType::kError:
      m = decodeBody<Error>(body, "error.", minor);
      break;
    default:
      return Corruption("frame.type: unknown message type " + std::to_string(h.type) +
                        " in a frame of version " + versionText(h.major, h.minor) +
                        " (this build speaks " + versionText(kWireVersionMajor, kWireVersionMinor) +
                        ")");
  }
  if (m.isOk() && frame_minor != nullptr) *frame_minor = minor;
  return m;
}

Status mixedMinor(const Message& m, uint16_t minor, uint16_t pinned) {
  return Corruption("frame.version: a " + std::string(messageTypeName(messageType(m))) +
                    " frame of minor " + std::to_string(minor) +
                    " on a connection whose hello came in minor " + std::to_string(pinned) +
                    " (one connection speaks one minor)");
}

Status checkDestination(const TransferRequest& req, const RankLayout& dst) {
  if (req.gen_tp_rank != dst.tp_rank || req.gen_pp_rank != dst.pp_rank) {
    return InvalidArgument(
        "transfer_request for generation rank (tp " + std::to_string(req.gen_tp_rank) + ", pp " +
        std::to_string(req.gen_pp_rank) + ") reached rank (tp " + std::to_string(dst.tp_rank) +
        ", pp " + std::to_string(dst.pp_rank) + ")");
  }
  bool has_kv = false, has_state = false;
  for (const PoolView& v : dst.views) (v.role == Role::kKv ? has_kv : has_state) = true;
  if (!has_kv && !req.dst_block_ids.empty()) {
    return InvalidArgument("transfer_request.dst_block_ids has " +
                           std::to_string(req.dst_block_ids.size()) +
                           " ids but the rank holds no attention layers");
  }
  std::vector<uint32_t> sorted = req.dst_block_ids;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] >= dst.num_blocks) {
      return InvalidArgument("transfer_request.dst_block_ids holds block " +
                             std::to_string(sorted[i]) +
                             " >= num_blocks=" + std::to_string(dst.num_blocks));
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return InvalidArgument("transfer_request.dst_block_ids holds block " +
                             std::to_string(sorted[i]) + " twice");
    }
  }
  if (has_state != req.dst_slot.has_value()) {
    return InvalidArgument(std::string("transfer_request.dst_slot is ") +
                           (req.dst_slot ? "present" : "absent") + " but the rank holds " +
                           (has_state ? "" : "no ") + "recurrent layers");
  }
  if (req.dst_slot && *req.dst_slot >= dst.num_slots) {
    return InvalidArgument("transfer_request.dst_slot=" + std::to_string(*req.dst_slot) +
                           " >= num_slots=" + std::to_string(dst.num_slots));
  }
  const size_t groups = has_state ? dst.state_groups - 1 : 0;
  if (req.dst_group_slots.size() != groups) {
    return InvalidArgument("transfer_request.dst_group_slots has " +
                           std::to_string(req.dst_group_slots.size()) + " ids but the rank has " +
                           std::to_string(groups) + " state groups besides dst_slot's");
  }
  for (size_t g = 0; g < groups; ++g) {
    const uint32_t id = req.dst_group_slots[g];
    const std::string what =
        "transfer_request.dst_group_slots[" + std::to_string(g) + "]=" + std::to_string(id);
    if (id >= dst.num_slots) {
      return InvalidArgument(what + " >= num_slots=" + std::to_string(dst.num_slots));
    }
  }
  if (dst.joint_ids && req.dst_slot) {
    // One pool: a state id that is also a block (or another group's state) of the request
    // would be written twice.
    std::vector<uint32_t> states = req.dst_group_slots;
    states.push_back(*req.dst_slot);
    std::sort(states.begin(), states.end());
    for (size_t i = 0; i < states.size(); ++i) {
      if ((i > 0 && states[i] == states[i - 1]) ||
          std::binary_search(sorted.begin(), sorted.end(), states[i])) {
        return InvalidArgument("transfer_request names id " + std::to_string(states[i]) +
                               " twice among its blocks and state ids, which share one pool");
      }
    }
  }
  if (req.first_block > req.dst_block_ids.size()) {
    return InvalidArgument("transfer_request.first_block=" + std::to_string(req.first_block) +
                           " is past the " + std::to_string(req.dst_block_ids.size()) + " blocks");
  }
  if (has_kv) {
    const uint64_t capacity = uint64_t{dst.tokens_per_block} * req.dst_block_ids.size();
    if (req.num_tokens > capacity) {
      return InvalidArgument("transfer_request.num_tokens=" + std::to_string(req.num_tokens) +
                             " does not fit " + std::to_string(req.dst_block_ids.size()) +
                             " blocks of " + std::to_string(dst.tokens_per_block) + " tokens");
    }
  }
  if (req.staging) {
    // A region of that rank's own RankInfo that is no pool: the part may land nowhere else.
    const Staging& st = *req.staging;
    const RegionSpec* region = dst.findRegion(st.region);
    const bool pool = std::any_of(dst.views.begin(), dst.views.end(),
                                  [&](const PoolView& v) { return v.region_id == st.region; });
    if (region == nullptr || pool) {
      return InvalidArgument("transfer_request.staging.region=" + std::to_string(st.region) +
                             (region == nullptr ? " is not a region of the rank"
                                                : " is a pool, not a staging region"));
    }
    if (st.offset > region->length || st.bytes > region->length - st.offset) {
      return InvalidArgument("transfer_request.staging [" + std::to_string(st.offset) + ", +" +
                             std::to_string(st.bytes) + ") is outside region " +
                             std::to_string(st.region) + " of " + std::to_string(region->length) +
                             " bytes");
    }
  }
  return OkStatus();
}

namespace {

std::string summary(const Hello& m) {
  const RankInfo& i = m.rank_info;
  return "hello instance=" + i.instance_id + " role=" + std::string(instanceRoleName(i.role)) +
         " rank=" + std::to_string(i.globalRank()) + " tp=" + std::to_string(i.layout.tp) +
         " pp=" + std::to_string(i.layout.pp) +
         " layout=" + std::string(stateLayoutName(i.layout.state_layout)) +
         " views=" + std::to_string(i.layout.views.size()) +
         " version=" + versionText(i.version_major, i.version_minor) +
         (m.auth_token.empty() ? "" : " token=yes") +
         (m.incarnation ? " incarnation=" + std::to_string(m.incarnation) : "");
}

std::string summary(const TransferRequest& m) {
  return "transfer_request id=" + std::to_string(m.request_id) + " gen=(" +
         std::to_string(m.gen_tp_rank) + "," + std::to_string(m.gen_pp_rank) +
         ") blocks=" + std::to_string(m.dst_block_ids.size()) +
         " first=" + std::to_string(m.first_block) +
         " slot=" + (m.dst_slot ? std::to_string(*m.dst_slot) : std::string("none")) +
         (m.dst_group_slots.empty() ? ""
                                    : " group_slots=" + std::to_string(m.dst_group_slots.size())) +
         " tokens=" + std::to_string(m.num_tokens) + " aux=" + std::to_string(m.aux.size()) +
         "B epoch=" + std::to_string(m.epoch) +
         (m.staging ? " staging=" + std::to_string(m.staging->region) + "@" +
                          std::to_string(m.staging->offset) + "+" + std::to_string(m.staging->bytes)
                    : "");
}

std::string summary(const TransferDone& m) {
  std::string s = "transfer_done id=" + std::to_string(m.request_id) +
                  " status=" + m.status.toString() + " bytes=" + std::to_string(m.bytes);
  if (m.checksum) {
    char text[32];
    std::snprintf(text, sizeof(text), " checksum=0x%016llx",
                  static_cast<unsigned long long>(*m.checksum));
    s += text;
  }
  return s + " aux=" + std::to_string(m.aux.size()) + "B epoch=" + std::to_string(m.epoch);
}

std::string summary(const Cancel& m) {
  return "cancel id=" + std::to_string(m.request_id) + " epoch=" + std::to_string(m.epoch) +
         " reason=" + m.reason;
}

std::string summary(const Error& m) { return "error " + m.status.toString(); }

}  // namespace

std::string summarize(const Message& m) {
  return std::visit([](const auto& v) { return summary(v); }, m);
}

}  // namespace hxfer::wire

#include "wire/codec.h"

namespace hxfer::wire {
namespace {

size_t varintLength(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace

void putString(Bytes& out, std::string_view s) { putLengthPrefixed(out, s); }
void putBytes(Bytes& out, std::span<const uint8_t> b) { putLengthPrefixed(out, b); }

std::string WireReader::name(std::string_view field) const {
  std::string n = path_;
  n.append(field);
  return n;
}

Status WireReader::corrupt(std::string_view field, const std::string& what) const {
  return Corruption(name(field) + ": " + what);
}

Status WireReader::need(std::string_view field, size_t n) const {
  if (remaining() < n) {
    return corrupt(field, "truncated: need " + std::to_string(n) + " bytes at offset " +
                              std::to_string(pos_) + ", have " + std::to_string(remaining()));
  }
  return OkStatus();
}

Status WireReader::u8(std::string_view field, uint8_t* v) {
  RETURN_IF_ERROR(need(field, 1));
  *v = in_[pos_++];
  return OkStatus();
}

Status WireReader::u16(std::string_view field, uint16_t* v) {
  RETURN_IF_ERROR(need(field, 2));
  *v = static_cast<uint16_t>(in_[pos_] | in_[pos_ + 1] << 8);
  pos_ += 2;
  return OkStatus();
}

Status WireReader::u64Fixed(std::string_view field, uint64_t* v) {
  RETURN_IF_ERROR(need(field, 8));
  *v = loadFixed64(in_.data() + pos_);
  pos_ += 8;
  return OkStatus();
}

Status WireReader::varint(std::string_view field, uint64_t max, uint64_t* v) {
  const size_t start = pos_;
  uint64_t result = 0;
  for (int shift = 0;; shift += 7) {
    if (pos_ >= in_.size()) {
      return corrupt(field, "truncated varint at offset " + std::to_string(start));
    }
    const uint8_t byte = in_[pos_++];
    if (shift == 63 && byte > 1) return corrupt(field, "varint overflows 64 bits");
    result |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) break;
    if (shift == 63) return corrupt(field, "varint longer than 10 bytes");
  }
  if (pos_ - start != varintLength(result)) {
    return corrupt(field, "non-canonical varint (" + std::to_string(pos_ - start) +
                              " bytes for the value " + std::to_string(result) + ")");
  }
  if (result > max) {
    return Corruption(name(field) + "=" + std::to_string(result) + " exceeds the limit " +
                      std::to_string(max));
  }
  *v = result;
  return OkStatus();
}

Status WireReader::varint32(std::string_view field, uint64_t max, uint32_t* v) {
  uint64_t x = 0;
  RETURN_IF_ERROR(varint(field, max < UINT32_MAX ? max : UINT32_MAX, &x));
  *v = static_cast<uint32_t>(x);
  return OkStatus();
}

Status WireReader::enumByte(std::string_view field, uint8_t max, uint8_t* v) {
  uint8_t x = 0;
  RETURN_IF_ERROR(u8(field, &x));
  if (x > max) {
    return corrupt(field, "unknown value " + std::to_string(x) + " (largest known is " +
                              std::to_string(max) + ")");
  }
  *v = x;
  return OkStatus();
}

Status WireReader::boolean(std::string_view field, bool* v) {
  uint8_t x = 0;
  RETURN_IF_ERROR(enumByte(field, 1, &x));
  *v = x == 1;
  return OkStatus();
}

Status WireReader::count(std::string_view field, uint64_t cap, size_t min_element_bytes,
                         size_t* n) {
  uint64_t c = 0;
  RETURN_IF_ERROR(varint(field, cap, &c));
  if (min_element_bytes > 0 && c > remaining() / min_element_bytes) {
    return corrupt(field, "count " + std::to_string(c) + " needs at least " +
                              std::to_string(c * min_element_bytes) + " bytes, only " +
                              std::to_string(remaining()) + " remain");
  }
  *n = static_cast<size_t>(c);
  return OkStatus();
}

Status WireReader::span(std::string_view field, uint64_t max_len, std::span<const uint8_t>* v) {
  uint64_t len = 0;
  RETURN_IF_ERROR(varint(std::string(field) + ".length", max_len, &len));
  RETURN_IF_ERROR(need(field, len));
  *v = in_.subspan(pos_, len);
  pos_ += len;
  return OkStatus();
}

Status WireReader::string(std::string_view field, uint64_t max_len, std::string* v) {
  std::span<const uint8_t> s;
  RETURN_IF_ERROR(span(field, max_len, &s));
  v->assign(reinterpret_cast<const char*>(s.data()), s.size());
  return OkStatus();
}

Status WireReader::bytes(std::string_view field, uint64_t max_len, Bytes* v) {
  std::span<const uint8_t> s;
  RETURN_IF_ERROR(span(field, max_len, &s));
  v->assign(s.begin(), s.end());
  return OkStatus();
}

Status WireReader::expectEnd(std::string_view what) const {
  if (remaining() != 0) {
    return Corruption(path_ + std::string(what) + ": " + std::to_string(remaining()) +
                      " unexpected trailing bytes at offset " + std::to_string(pos_));
  }
  return OkStatus();
}

}  // namespace hxfer::wire

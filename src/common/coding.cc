#include "common/coding.h"

#include <cstring>

namespace hxfer {

void putFixed8(Bytes& out, uint8_t v) { out.push_back(v); }

void putFixed16(Bytes& out, uint16_t v) {
  out.push_back(static_cast<uint8_t>(v));
  out.push_back(static_cast<uint8_t>(v >> 8));
}

void putFixed32(Bytes& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void putFixed64(Bytes& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void putVarint64(Bytes& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

void putLengthPrefixed(Bytes& out, std::span<const uint8_t> bytes) {
  putVarint64(out, bytes.size());
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void putLengthPrefixed(Bytes& out, std::string_view s) {
  putLengthPrefixed(out, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()),
                                                  s.size()));
}

uint32_t loadFixed32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

uint64_t loadFixed64(const uint8_t* p) {
  return static_cast<uint64_t>(loadFixed32(p)) | static_cast<uint64_t>(loadFixed32(p + 4)) << 32;
}

void storeFixed32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

Status Decoder::need(std::string_view field, size_t n) const {
  if (in_.size() - pos_ < n) {
    return Corruption("truncated reading " + std::string(field) + ": need " + std::to_string(n) +
                      " bytes at offset " + std::to_string(pos_) + ", have " +
                      std::to_string(in_.size() - pos_));
  }
  return OkStatus();
}

Status Decoder::getFixed8(std::string_view field, uint8_t* v) {
  RETURN_IF_ERROR(need(field, 1));
  *v = in_[pos_++];
  return OkStatus();
}

Status Decoder::getFixed16(std::string_view field, uint16_t* v) {
  RETURN_IF_ERROR(need(field, 2));
  *v = static_cast<uint16_t>(in_[pos_] | in_[pos_ + 1] << 8);
  pos_ += 2;
  return OkStatus();
}

Status Decoder::getFixed32(std::string_view field, uint32_t* v) {
  RETURN_IF_ERROR(need(field, 4));
  *v = loadFixed32(in_.data() + pos_);
  pos_ += 4;
  return OkStatus();
}

Status Decoder::getFixed64(std::string_view field, uint64_t* v) {
  RETURN_IF_ERROR(need(field, 8));
  *v = loadFixed64(in_.data() + pos_);
  pos_ += 8;
  return OkStatus();
}

Status Decoder::getVarint64(std::string_view field, uint64_t* v) {
  uint64_t result = 0;
  for (int shift = 0; shift <= 63; shift += 7) {
    if (pos_ >= in_.size()) {
      return Corruption("truncated varint reading " + std::string(field) + " at offset " +
                        std::to_string(pos_));
    }
    uint8_t byte = in_[pos_++];
    if (shift == 63 && byte > 1) {
      return Corruption("varint overflows 64 bits reading " + std::string(field));
    }
    result |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) {
      *v = result;
      return OkStatus();
    }
  }
  return Corruption("varint longer than 10 bytes reading " + std::string(field));
}

Status Decoder::getBoundedVarint(std::string_view field, uint64_t max, uint64_t* v) {
  uint64_t value = 0;
  RETURN_IF_ERROR(getVarint64(field, &value));
  if (value > max) {
    return Corruption(std::string(field) + "=" + std::to_string(value) + " exceeds the limit " +
                      std::to_string(max));
  }
  *v = value;
  return OkStatus();
}

Status Decoder::getLengthPrefixed(std::string_view field, uint64_t max_len,
                                  std::span<const uint8_t>* v) {
  uint64_t len = 0;
  RETURN_IF_ERROR(getBoundedVarint(std::string(field) + ".length", max_len, &len));
  RETURN_IF_ERROR(need(field, len));
  *v = in_.subspan(pos_, len);
  pos_ += len;
  return OkStatus();
}

Status Decoder::getString(std::string_view field, uint64_t max_len, std::string* v) {
  std::span<const uint8_t> s;
  RETURN_IF_ERROR(getLengthPrefixed(field, max_len, &s));
  v->assign(reinterpret_cast<const char*>(s.data()), s.size());
  return OkStatus();
}

Status Decoder::getBytes(std::string_view field, uint64_t max_len, Bytes* v) {
  std::span<const uint8_t> s;
  RETURN_IF_ERROR(getLengthPrefixed(field, max_len, &s));
  v->assign(s.begin(), s.end());
  return OkStatus();
}

}  // namespace hxfer

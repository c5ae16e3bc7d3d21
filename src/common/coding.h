// Little-endian fixed-width and varint coding (leveldb util/coding.h in spirit).
//
// Encoder appends to a byte string. Decoder is a bounds-checked cursor over a byte span: every
// read either succeeds or returns Corruption naming the field being read; it never reads past
// the end. Neither owns threads; use one per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace hxfer {

using Bytes = std::vector<uint8_t>;

void putFixed8(Bytes& out, uint8_t v);
void putFixed16(Bytes& out, uint16_t v);
void putFixed32(Bytes& out, uint32_t v);
void putFixed64(Bytes& out, uint64_t v);
void putVarint64(Bytes& out, uint64_t v);
// Varint length prefix followed by the bytes.
void putLengthPrefixed(Bytes& out, std::span<const uint8_t> bytes);
void putLengthPrefixed(Bytes& out, std::string_view s);

uint32_t loadFixed32(const uint8_t* p);
uint64_t loadFixed64(const uint8_t* p);
void storeFixed32(uint8_t* p, uint32_t v);

class Decoder {
 public:
  explicit Decoder(std::span<const uint8_t> in) : in_(in) {}

  // Each getter names `field` in its error: "truncated reading regions[2].length".
  Status getFixed8(std::string_view field, uint8_t* v);
  Status getFixed16(std::string_view field, uint16_t* v);
  Status getFixed32(std::string_view field, uint32_t* v);
  Status getFixed64(std::string_view field, uint64_t* v);
  // Varints longer than 10 bytes or overflowing 64 bits are Corruption.
  Status getVarint64(std::string_view field, uint64_t* v);
  // A varint that must be <= max (a count or a size cap): larger is Corruption naming both.
  Status getBoundedVarint(std::string_view field, uint64_t max, uint64_t* v);
  // Length-prefixed bytes of at most max_len bytes.
  Status getLengthPrefixed(std::string_view field, uint64_t max_len, std::span<const uint8_t>* v);
  Status getString(std::string_view field, uint64_t max_len, std::string* v);
  Status getBytes(std::string_view field, uint64_t max_len, Bytes* v);

  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  bool done() const { return pos_ == in_.size(); }
  std::span<const uint8_t> rest() const { return in_.subspan(pos_); }

 private:
  Status need(std::string_view field, size_t n) const;

  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

}  // namespace hxfer

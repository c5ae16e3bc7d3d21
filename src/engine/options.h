// Options shared by both sides of the transceiver (ContextSender, GenerationReceiver).
//
// Values; safe to copy between threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "model/model.h"

namespace hxfer::engine {

using Clock = std::chrono::steady_clock;

struct EngineOptions {
  std::string instance_id = "hxfer";  // names this serving instance in RankInfo and logs
  ModelSpec model;                    // the model both instances serve
  ParallelConfig parallel;            // this instance's tp/pp
  uint32_t tp_rank = 0;
  uint32_t pp_rank = 0;
  // Context: hash the bytes of every request part and send the checksum with TransferDone.
  // Generation: verify every checksum that arrives against the bytes that landed.
  bool checksum = false;
  // How long the progress thread waits for an event when nothing is in flight.
  std::chrono::milliseconds idle_poll{5};
};

}  // namespace hxfer::engine

// EventWatcher: wakes a progress thread as device events complete.
//
// The device runtime has no completion callback here, and a progress thread sleeps in its
// agent's pollEvent: a thread of the watcher's own (started with the first event) waits for the
// events in the order they were given and calls `done` after each one completes. Events of one
// stream complete in order, so waiting for the oldest first costs one wake per event.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "device/device_api.h"

namespace hxfer::engine {

class EventWatcher {
 public:
  // `done` runs on the watcher's thread, without any lock of the watcher held.
  explicit EventWatcher(std::function<void()> done) : done_(std::move(done)) {}
  ~EventWatcher() { stop(); }
  EventWatcher(const EventWatcher&) = delete;
  EventWatcher& operator=(const EventWatcher&) = delete;

  void watch(std::shared_ptr<const device::Event> event);
  // Ends the thread (within one 50 ms wait); events still pending are no longer watched.
  // Idempotent; watch() after it is ignored.
  void stop();

 private:
  void loop();

  const std::function<void()> done_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<const device::Event>> events_;  // guarded by mu_
  bool stop_ = false;                                        // guarded by mu_
  std::thread thread_;                                       // started under mu_
};

}  // namespace hxfer::engine

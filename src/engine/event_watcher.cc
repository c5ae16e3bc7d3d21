#include "engine/event_watcher.h"

#include <chrono>

namespace hxfer::engine {

void EventWatcher::watch(std::shared_ptr<const device::Event> event) {
  std::lock_guard lock(mu_);
  if (stop_) return;
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  events_.push_back(std::move(event));
  cv_.notify_one();
}

void EventWatcher::stop() {
  std::thread thread;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    cv_.notify_all();
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void EventWatcher::loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !events_.empty(); });
    if (stop_) return;
    std::shared_ptr<const device::Event> event = events_.front();
    lock.unlock();
    (void)event->wait(std::chrono::milliseconds(50));  // bounded: stop is seen
    lock.lock();
    if (event->done()) {
      events_.pop_front();
      lock.unlock();
      done_();
      lock.lock();
    }
  }
}

}  // namespace hxfer::engine

#include "device/worker_stream.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <variant>

#include "device/fake_device.h"

namespace hxfer::device {
namespace {

class WorkerStream : public Stream {
 public:
  explicit WorkerStream(StreamOps ops) : ops_(std::move(ops)) {
    worker_ = std::thread([this] { run(); });
  }

  ~WorkerStream() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    for (Item& item : queue_) {
      item.done->signal(Cancelled("the stream was destroyed before this ran"));
    }
    if (ops_.on_stop) ops_.on_stop();
  }

  StatusOr<std::shared_ptr<Event>> copy(const HostCopyTable& table) override {
    return push(Item{table, std::make_shared<ManualEvent>()});
  }
  StatusOr<std::shared_ptr<Event>> pack(const HostPackTable& table) override {
    return push(Item{table, std::make_shared<ManualEvent>()});
  }
  Status waitFor(std::shared_ptr<const Event> event) override {
    if (!event) return InvalidArgument("stream waitFor without an event");
    return push(Item{std::move(event), std::make_shared<ManualEvent>()}).status();
  }
  StatusOr<std::shared_ptr<Event>> record() override {
    return push(Item{std::monostate{}, std::make_shared<ManualEvent>()});
  }

 private:
  struct Item {
    std::variant<std::monostate, HostCopyTable, HostPackTable, std::shared_ptr<const Event>> work;
    std::shared_ptr<ManualEvent> done;
  };

  StatusOr<std::shared_ptr<Event>> push(Item item) {
    std::shared_ptr<Event> done = item.done;
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
    return done;
  }

  // Runs one item; false when the stream is stopping while it waited for an event.
  bool runOne(Item& item) {
    if (auto* e = std::get_if<std::shared_ptr<const Event>>(&item.work)) {
      while (!(*e)->done()) {
        {
          std::lock_guard lock(mu_);
          if (stopping_) return false;
        }
        (void)(*e)->wait(std::chrono::milliseconds(5));
      }
      item.done->signal();
      return true;
    }
    if (std::holds_alternative<std::monostate>(item.work)) {
      item.done->signal(first_error_);
      return true;
    }
    Status s = start_status_;
    if (s.isOk()) {
      if (auto* c = std::get_if<HostCopyTable>(&item.work)) {
        s = ops_.copy(*c);
      } else {
        s = ops_.pack(std::get<HostPackTable>(item.work));
      }
    }
    if (!s.isOk() && first_error_.isOk()) first_error_ = s;
    item.done->signal(s);
    return true;
  }

  void run() {
    if (ops_.on_start) start_status_ = ops_.on_start();
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;  // what is left is cancelled by the destructor
      Item item = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      const bool finished = runOne(item);
      lock.lock();
      if (!finished) {
        queue_.push_front(std::move(item));
        return;
      }
    }
  }

  StreamOps ops_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  Status start_status_;  // of on_start; every op fails with it when not ok (worker only)
  Status first_error_;   // of this stream's ops; the worker's alone
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Stream> makeWorkerStream(StreamOps ops) {
  return std::make_unique<WorkerStream>(std::move(ops));
}

}  // namespace hxfer::device

#include "transport/ucx.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/coding.h"
#include "common/logging.h"
#include "transport/local_common.h"
#include "transport/transfer_core.h"

namespace hxfer::transport {
namespace {

using detail::TransferCore;

constexpr std::string_view kScheme = "ucx:";
constexpr uint32_t kProtocolVersion = 1;
constexpr uint64_t kMaxMessageBytes = 64ull << 20;

// Active message ids (docs/transport.md has the header layouts).
enum AmId : unsigned {
  kAmHello = 1,     // header: fixed32 version
  kAmHelloAck = 2,  // header: fixed32 version
  kAmMessage = 3,   // header: fixed64 seq; data: the user's payload
  kAmWrite = 4,     // header: fixed64 transfer, fixed32 op_count, fixed32 region,
                    //         fixed64 offset, fixed64 bytes; data: the bytes
  kAmWriteAck = 5,  // header: fixed64 transfer, fixed32 status code; data: error message
};

Status ucxError(std::string_view what, ucs_status_t st) {
  return Unavailable(std::string(what) + ": " + ucs_status_string(st));
}

struct RemoteRegion {
  uint64_t length = 0;
  uint64_t address = 0;
  ucp_rkey_h rkey = nullptr;  // progress thread
};

struct LocalRegion {
  const Region* region = nullptr;
  ucp_mem_h memh = nullptr;
};

// An outgoing batch (progress thread only, except `core`).
struct OutTransfer {
  std::shared_ptr<TransferCore> core;
  size_t sends_outstanding = 0;
  bool remote_done = false;  // ack (am) or flush (put) arrived
  Status first_error;
};

// An incoming am batch being received (progress thread only).
struct InTransfer {
  uint32_t op_count = 0;
  uint32_t accounted = 0;  // received or rejected
  uint32_t in_flight = 0;  // rendezvous receives started, not finished
  Status first_error;
};

struct UcxPeer {
  PeerId id = 0;
  bool incoming = false;
  std::atomic<bool> lost{false};
  std::atomic<bool> acked{false};
  bool use_put = false;  // decided when the connection is up

  // Guarded by the agent's mu_ (read by API threads for validation).
  std::map<uint32_t, RemoteRegion> remote_regions;

  // Progress thread only.
  ucp_ep_h ep = nullptr;
  uint64_t next_send_seq = 0;
  uint64_t next_recv_seq = 0;
  std::map<uint64_t, std::vector<uint8_t>> reorder;
  std::unordered_map<uint64_t, OutTransfer> out;
  std::unordered_map<uint64_t, InTransfer> in;
};

struct ReqCtx;
class UcxAgent;

// The error-callback argument of one endpoint; owned by the agent (freed at teardown).
struct EpErrArg {
  UcxAgent* agent;
  UcxPeer* peer;
};

class UcxAgent final : public Agent {
 public:
  UcxAgent(const AgentConfig& config) : config_(config) {
    caps_.name = "ucx";
    caps_.same_host_only = false;
    caps_.one_sided = config.ucx_mode == UcxMode::kPut;
    caps_.many_small_ops_cheap = false;
    caps_.needs_memfd_regions = false;
    caps_.max_message_bytes = kMaxMessageBytes;
  }

  ~UcxAgent() override {
    if (progress_.joinable()) {
      post([this] { stopping_ = true; });
      progress_.join();
    }
    teardown();
  }

  Status init();

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return address_; }

  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region, RegionAccess access) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (regions_.count(region.id()) != 0) {
        return InvalidArgument("region id=" + std::to_string(region.id()) +
                               " is already registered");
      }
    }
    return runSync<std::vector<uint8_t>>([&]() -> StatusOr<std::vector<uint8_t>> {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = region.data();
      mp.length = region.length() == 0 ? 1 : region.length();
      ucp_mem_h memh = nullptr;
      ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
      if (st != UCS_OK) return ucxError("ucp_mem_map of region " + std::to_string(region.id()), st);
      void* rkey_buf = nullptr;
      size_t rkey_len = 0;
      st = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_len);
      if (st != UCS_OK) {
        ucp_mem_unmap(context_, memh);
        return ucxError("ucp_rkey_pack of region " + std::to_string(region.id()), st);
      }
      std::vector<uint8_t> key;
      putFixed64(key, reinterpret_cast<uint64_t>(region.data()));
      putFixed64(key, region.length());
      key.insert(key.end(), static_cast<uint8_t*>(rkey_buf),
                 static_cast<uint8_t*>(rkey_buf) + rkey_len);
      ucp_rkey_buffer_release(rkey_buf);
      std::lock_guard<std::mutex> lock(mu_);
      regions_[region.id()] = LocalRegion{&region, memh};
      return key;
    });
  }

  Status deregisterRegion(uint32_t region_id) override {
    return runSync<bool>([&]() -> StatusOr<bool> {
             LocalRegion r;
             {
               std::lock_guard<std::mutex> lock(mu_);
               auto it = regions_.find(region_id);
               if (it == regions_.end()) {
                 return NotFound("region id=" + std::to_string(region_id) + " is not registered");
               }
               r = it->second;
               regions_.erase(it);
             }
             ucp_mem_unmap(context_, r.memh);
             return true;
           })
        .status();
  }

  StatusOr<PeerId> connect(const std::string& address) override;

  Status disconnect(PeerId peer) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    post([this, p] {
      markLost(p, Unavailable("peer " + std::to_string(p->id) + " was disconnected"));
    });
    return OkStatus();
  }

  Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                         std::span<const uint8_t> key) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    if (key.size() < 16) {
      return InvalidArgument("ucx key of remote region id=" + std::to_string(region_id) + " has " +
                             std::to_string(key.size()) + " bytes, expected >= 16");
    }
    std::vector<uint8_t> rkey_bytes(key.begin() + 16, key.end());
    const uint64_t address = loadFixed64(key.data());
    const uint64_t real_length = loadFixed64(key.data() + 8);
    if (length > real_length) {
      return InvalidArgument(
          "remote region id=" + std::to_string(region_id) + " length=" + std::to_string(length) +
          " exceeds the peer's registered length=" + std::to_string(real_length));
    }
    return runSync<bool>([&]() -> StatusOr<bool> {
             if (p->lost || p->ep == nullptr) {
               return Unavailable("peer " + std::to_string(peer) + " is gone");
             }
             RemoteRegion rr{length, address, nullptr};
             if (p->use_put) {
               ucs_status_t st = ucp_ep_rkey_unpack(p->ep, rkey_bytes.data(), &rr.rkey);
               if (st != UCS_OK) {
                 return InvalidArgument("ucp_ep_rkey_unpack of remote region id=" +
                                        std::to_string(region_id) + ": " + ucs_status_string(st));
               }
             }
             std::lock_guard<std::mutex> lock(mu_);
             auto& slot = p->remote_regions[region_id];
             if (slot.rkey != nullptr) ucp_rkey_destroy(slot.rkey);
             slot = rr;
             return true;
           })
        .status();
  }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override;

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    RETURN_IF_ERROR(detail::checkMessageSize(payload.size(), kMaxMessageBytes));
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    auto data = std::make_shared<std::vector<uint8_t>>(payload.begin(), payload.end());
    post([this, p, data] {
      if (p->lost) return;
      Bytes header;
      putFixed64(header, p->next_send_seq++);
      sendAm(p, kAmMessage, std::move(header), data->data(), data->size(), data,
             UCP_AM_SEND_FLAG_EAGER, /*transfer=*/0);
    });
    return OkStatus();
  }

  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    return events_.pop(timeout);
  }
  void wakeEventWaiter() override { events_.wake(); }

  // --- progress-thread callbacks (static trampolines call these) ---
  void onConnRequest(ucp_conn_request_h req);
  void onEpError(UcxPeer* raw, ucp_ep_h ep, ucs_status_t st);
  ucs_status_t onAm(unsigned id, const void* header, size_t header_length, void* data,
                    size_t length, const ucp_am_recv_param_t* param);
  void onSendDone(ReqCtx* ctx, ucs_status_t st);
  void onRecvDone(ReqCtx* ctx, ucs_status_t st);
  void onFlushDone(ReqCtx* ctx, ucs_status_t st);

 private:
  std::shared_ptr<UcxPeer> findPeer(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second;
  }

  void pushEvent(Event e) { events_.push(std::move(e)); }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      commands_.push_back(std::move(fn));
    }
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // Runs `fn` on the progress thread and waits for its result.
  template <typename T>
  StatusOr<T> runSync(std::function<StatusOr<T>()> fn) {
    std::promise<StatusOr<T>> done;
    auto fut = done.get_future();
    post([&] { done.set_value(fn()); });
    return fut.get();
  }

  void progressLoop();
  void drainLostPeers(bool force);
  void teardown();
  std::shared_ptr<UcxPeer> addPeer(ucp_ep_h ep, bool incoming);
  void markLost(const std::shared_ptr<UcxPeer>& p, const Status& why, bool queue_event = true);
  StatusOr<ucp_ep_h> createEp(const std::shared_ptr<UcxPeer>& p, ucp_ep_params_t params);
  void decideMode(const std::shared_ptr<UcxPeer>& p);
  void sendAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Bytes header, const void* data,
              size_t length, std::shared_ptr<void> keep, uint32_t flags, uint64_t transfer);
  void startWrite(const std::shared_ptr<UcxPeer>& p, uint64_t tid,
                  std::shared_ptr<TransferCore> core, std::vector<WriteOp> ops);
  void maybeFinishOut(const std::shared_ptr<UcxPeer>& p, uint64_t tid);
  void maybeAckIn(const std::shared_ptr<UcxPeer>& p, uint64_t tid);
  void deliverMessages(const std::shared_ptr<UcxPeer>& p);
  std::shared_ptr<UcxPeer> peerOfEp(ucp_ep_h ep) {
    auto it = ep_peers_.find(ep);
    return it == ep_peers_.end() ? nullptr : it->second;
  }

  const AgentConfig config_;
  Capabilities caps_;
  std::string address_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread progress_;
  bool stopping_ = false;  // progress thread only

  std::mutex cmd_mu_;
  std::deque<std::function<void()>> commands_;  // guarded by cmd_mu_

  std::mutex mu_;
  std::condition_variable ack_cv_;
  std::map<uint32_t, LocalRegion> regions_;                     // guarded by mu_
  std::unordered_map<PeerId, std::shared_ptr<UcxPeer>> peers_;  // guarded by mu_
  PeerId next_peer_ = 1;                                        // guarded by mu_
  std::atomic<uint64_t> next_transfer_{1};

  std::unordered_map<ucp_ep_h, std::shared_ptr<UcxPeer>> ep_peers_;  // progress thread
  std::vector<void*> closing_;                                       // progress thread
  std::vector<EpErrArg*> err_args_;                                  // progress thread
  // Lost peers whose writes still wait for UCX to hand back requests; forced after a deadline.
  std::vector<std::pair<std::shared_ptr<UcxPeer>, Clock::time_point>> draining_;  // progress

  // Sleeps on an eventfd, like the local transports' queues: a condition-variable hand-off
  // measured about 300 us per control round trip on a loaded machine.
  detail::EventQueue events_;
};

// Context of one UCX request callback; owned by the callback (deleted there).
struct ReqCtx {
  UcxAgent* agent = nullptr;
  PeerId peer = 0;
  uint64_t transfer = 0;       // 0: not part of a transfer (a control message)
  Bytes header;                // the AM header, alive until the send completes
  std::shared_ptr<void> keep;  // keeps a send buffer alive
};

template <unsigned Id>
ucs_status_t amHandler(void* arg, const void* header, size_t header_length, void* data,
                       size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<UcxAgent*>(arg)->onAm(Id, header, header_length, data, length, param);
}

void connHandler(ucp_conn_request_h req, void* arg) {
  static_cast<UcxAgent*>(arg)->onConnRequest(req);
}

void epErrHandler(void* arg, ucp_ep_h ep, ucs_status_t st) {
  auto* a = static_cast<EpErrArg*>(arg);
  a->agent->onEpError(a->peer, ep, st);
}

void sendCallback(void* request, ucs_status_t st, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onSendDone(ctx, st);
  ucp_request_free(request);
}

void recvCallback(void* request, ucs_status_t st, size_t length, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onRecvDone(ctx, st);
  ucp_request_free(request);
}

void flushCallback(void* request, ucs_status_t st, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onFlushDone(ctx, st);
  ucp_request_free(request);
}

StatusOr<sockaddr_in> parseIpPort(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgument("ucx address '" + s + "' is not ip:port");
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  const std::string host = s.substr(0, colon);
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    return InvalidArgument("ucx address '" + s + "': '" + host + "' is not an IPv4 address");
  }
  char* end = nullptr;
  const std::string port_text = s.substr(colon + 1);
  unsigned long port = std::strtoul(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port > 65535) {
    return InvalidArgument("ucx address '" + s + "': port '" + port_text + "' is not 0..65535");
  }
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

// Ep lanes that do real one-sided RMA; put over anything else (tcp, shared-memory emulation
// in UCX 1.13) was measured far slower than active messages.
bool lanesDoRealRma(const std::string& info) {
  for (const char* tl : {"rc_verbs", "rc_mlx5", "dc_mlx5", "rc_x", "dc_x", "cuda_ipc", "rocm_ipc",
                         "gdr_copy", "ud_mlx5"}) {
    size_t pos = 0;
    while ((pos = info.find(tl, pos)) != std::string::npos) {
      const size_t eol = info.find('\n', pos);
      if (info.substr(pos, eol - pos).find("rma") != std::string::npos) return true;
      pos += 1;
    }
  }
  return false;
}

Status UcxAgent::init() {
  ucp_config_t* cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  if (st != UCS_OK) return ucxError("ucp_config_read", st);
  for (const auto& [name, value] : config_.ucx_options) {
    st = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(cfg);
      return InvalidArgument("ucx option " + name + "=" + value + ": " + ucs_status_string(st));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  st = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  if (st != UCS_OK) return ucxError("ucp_init", st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) return ucxError("ucp_worker_create", st);
  st = ucp_worker_get_efd(worker_, &worker_fd_);
  if (st != UCS_OK) return ucxError("ucp_worker_get_efd", st);

  auto set_handler = [&](unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = cb;
    hp.arg = this;
    return ucp_worker_set_am_recv_handler(worker_, &hp);
  };
  for (auto [id, cb] :
       {std::pair{kAmHello, &amHandler<kAmHello>}, std::pair{kAmHelloAck, &amHandler<kAmHelloAck>},
        std::pair{kAmMessage, &amHandler<kAmMessage>}, std::pair{kAmWrite, &amHandler<kAmWrite>},
        std::pair{kAmWriteAck, &amHandler<kAmWriteAck>}}) {
    st = set_handler(id, cb);
    if (st != UCS_OK) return ucxError("ucp_worker_set_am_recv_handler", st);
  }

  const std::string listen = config_.listen.empty() ? "127.0.0.1:0" : config_.listen;
  ASSIGN_OR_RETURN(sockaddr_in sa, parseIpPort(listen));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = connHandler;
  lp.conn_handler.arg = this;
  st = ucp_listener_create(worker_, &lp, &listener_);
  if (st != UCS_OK) return ucxError("ucp_listener_create on " + listen, st);
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  st = ucp_listener_query(listener_, &la);
  if (st != UCS_OK) return ucxError("ucp_listener_query", st);
  const auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
  char ip[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  address_ = std::string(kScheme) + ip + ":" + std::to_string(ntohs(bound->sin_port));

  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) return ResourceExhausted("eventfd/epoll_create1 failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  ev.data.fd = worker_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, worker_fd_, &ev);
  HXFER_LOG_DEBUG("ucx {}: listening on {}", config_.label, address_);
  progress_ = std::thread([this] { progressLoop(); });
  return OkStatus();
}

void UcxAgent::progressLoop() {
  while (!stopping_) {
    std::deque<std::function<void()>> cmds;
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
    unsigned progressed = 0;
    while (ucp_worker_progress(worker_) != 0) ++progressed;
    if (!draining_.empty()) drainLostPeers(/*force=*/false);
    if (stopping_) break;
    if (progressed != 0 || !cmds.empty()) continue;
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      if (!commands_.empty()) continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    epoll_event evs[2];
    epoll_wait(epoll_fd_, evs, 2, 100);
    uint64_t v;
    while (read(wake_fd_, &v, sizeof(v)) > 0) {
    }
  }
}

void UcxAgent::drainLostPeers(bool force) {
  const auto now = Clock::now();
  std::erase_if(draining_, [&](auto& entry) {
    auto& [p, deadline] = entry;
    if (p->out.empty()) return true;
    if (!force && now < deadline) return false;
    for (auto& [tid, t] : p->out) t.core->complete(t.first_error);
    p->out.clear();
    return true;
  });
}

void UcxAgent::teardown() {
  // Runs after the progress thread stopped: this thread now owns the worker.
  std::vector<std::shared_ptr<UcxPeer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : peers_) peers.push_back(p);
  }
  const Status gone = Unavailable("ucx agent " + address_ + " shut down");
  for (auto& p : peers) {
    if (p->ep == nullptr) continue;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    ep_peers_.erase(p->ep);
    p->ep = nullptr;
  }
  drainLostPeers(/*force=*/true);
  for (auto& p : peers) {
    p->lost = true;
    for (auto& [tid, t] : p->out) t.core->complete(gone);
    p->out.clear();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : p->remote_regions) {
      if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
    }
    p->remote_regions.clear();
  }
  if (worker_ != nullptr) {
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (!closing_.empty() && Clock::now() < deadline) {
      ucp_worker_progress(worker_);
      std::erase_if(closing_, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
  }
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : regions_) ucp_mem_unmap(context_, r.memh);
    regions_.clear();
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  for (auto* a : err_args_) delete a;
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

StatusOr<ucp_ep_h> UcxAgent::createEp(const std::shared_ptr<UcxPeer>& p, ucp_ep_params_t params) {
  auto* arg = new EpErrArg{this, p.get()};
  err_args_.push_back(arg);
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = epErrHandler;
  params.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(worker_, &params, &ep);
  if (st != UCS_OK) return ucxError("ucp_ep_create", st);
  p->ep = ep;
  ep_peers_[ep] = p;
  return ep;
}

std::shared_ptr<UcxPeer> UcxAgent::addPeer(ucp_ep_h ep, bool incoming) {
  auto p = std::make_shared<UcxPeer>();
  p->incoming = incoming;
  std::lock_guard<std::mutex> lock(mu_);
  p->id = next_peer_++;
  peers_.emplace(p->id, p);
  return p;
}

StatusOr<PeerId> UcxAgent::connect(const std::string& address) {
  if (!address.starts_with(kScheme)) {
    return InvalidArgument("ucx address '" + address + "' does not start with 'ucx:'");
  }
  ASSIGN_OR_RETURN(sockaddr_in sa, parseIpPort(address.substr(kScheme.size())));
  auto p = addPeer(nullptr, /*incoming=*/false);
  Status s =
      runSync<bool>([&]() -> StatusOr<bool> {
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
        ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
        ep.sockaddr.addrlen = sizeof(sa);
        RETURN_IF_ERROR(createEp(p, ep).status());
        Bytes hello;
        putFixed32(hello, kProtocolVersion);
        sendAm(p, kAmHello, std::move(hello), nullptr, 0, nullptr, UCP_AM_SEND_FLAG_EAGER, 0);
        return true;
      }).status();
  if (s.isOk()) {
    std::unique_lock<std::mutex> lock(mu_);
    ack_cv_.wait_for(lock, config_.connect_timeout, [&] { return p->acked || p->lost; });
    if (!p->acked) s = Unavailable("ucx agent at " + address + " did not answer the hello");
  }
  if (!s.isOk()) {
    post([this, p, s] { markLost(p, s, /*queue_event=*/false); });
    return s;
  }
  return p->id;
}

StatusOr<Transfer> UcxAgent::postWrite(PeerId peer, std::vector<WriteOp> ops) {
  auto p = findPeer(peer);
  if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
  if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
  uint64_t total = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      const WriteOp& op = ops[i];
      ASSIGN_OR_RETURN(auto regions,
                       detail::findOpRegions(i, op, peer, regions_, p->remote_regions));
      const auto& [local, remote] = regions;
      RETURN_IF_ERROR(detail::validateOp(i, op, local->region->length(), remote->length));
      total += op.bytes;
    }
  }
  if (ops.empty()) return detail::finishedTransfer(OkStatus());
  if (ops.size() > UINT32_MAX) {
    return InvalidArgument("batch of " + std::to_string(ops.size()) + " ops exceeds 2^32-1");
  }
  auto core = std::make_shared<TransferCore>(total, ops.size());
  const uint64_t tid = next_transfer_.fetch_add(1);
  post([this, p, tid, core, ops = std::move(ops)]() mutable {
    startWrite(p, tid, core, std::move(ops));
  });
  return Transfer(core);
}

void UcxAgent::onConnRequest(ucp_conn_request_h req) {
  if (stopping_) {
    ucp_listener_reject(listener_, req);
    return;
  }
  auto p = addPeer(nullptr, /*incoming=*/true);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  ep.conn_request = req;
  auto r = createEp(p, ep);
  if (!r.isOk()) {
    HXFER_LOG_WARN("ucx {}: accepting a connection failed: {}", config_.label,
                   r.status().toString());
    p->lost = true;
  }
}

void UcxAgent::onEpError(UcxPeer* raw, ucp_ep_h ep, ucs_status_t st) {
  auto p = peerOfEp(ep);
  if (!p) return;
  markLost(p, ucxError("ucx endpoint of peer " + std::to_string(p->id) + " failed", st));
}

void UcxAgent::markLost(const std::shared_ptr<UcxPeer>& p, const Status& why, bool queue_event) {
  if (p->lost.exchange(true)) return;
  // Pending writes fail with `why`, but only once UCX handed back every request of theirs (the
  // forced close below cancels them): a terminal transfer never has memory access in flight.
  for (auto& [tid, t] : p->out) {
    if (t.first_error.isOk()) t.first_error = why;
    t.remote_done = true;
  }
  p->in.clear();
  p->reorder.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : p->remote_regions) {
      if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
    }
    p->remote_regions.clear();
  }
  ack_cv_.notify_all();
  if (p->ep != nullptr) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    ep_peers_.erase(p->ep);
    p->ep = nullptr;
  }
  std::vector<uint64_t> tids;
  for (auto& [tid, t] : p->out) tids.push_back(tid);
  for (uint64_t tid : tids) maybeFinishOut(p, tid);
  if (!p->out.empty()) draining_.push_back({p, Clock::now() + std::chrono::seconds(5)});
  std::erase_if(closing_, [](void* r) {
    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    ucp_request_free(r);
    return true;
  });
  HXFER_LOG_DEBUG("ucx {}: peer {} lost: {}", config_.label, p->id, why.toString());
  if (queue_event) pushEvent(Event{Event::Kind::kPeerLost, p->id, {}, why});
}

void UcxAgent::decideMode(const std::shared_ptr<UcxPeer>& p) {
  std::string reason;
  if (config_.ucx_mode == UcxMode::kPut) {
    p->use_put = true;
    reason = "forced by config";
  } else if (config_.ucx_mode == UcxMode::kAm) {
    p->use_put = false;
    reason = "forced by config";
  } else {
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    std::string info;
    if (f != nullptr) {
      ucp_ep_print_info(p->ep, f);
      std::fclose(f);
      info.assign(buf, len);
      std::free(buf);
    }
    p->use_put = lanesDoRealRma(info);
    reason = p->use_put ? "the endpoint's RMA lanes are real RMA"
                        : "put would be emulated on these lanes (tcp / shared memory)";
  }
  HXFER_LOG_INFO("ucx {}: peer {} data mode {} ({})", config_.label, p->id,
                 p->use_put ? "put" : "am", reason);
}

void UcxAgent::sendAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Bytes header,
                      const void* data, size_t length, std::shared_ptr<void> keep, uint32_t flags,
                      uint64_t transfer) {
  auto* ctx = new ReqCtx{this, p->id, transfer, std::move(header), std::move(keep)};
  if (p->ep == nullptr) {
    onSendDone(ctx, UCS_ERR_NOT_CONNECTED);
    return;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = flags | UCP_AM_SEND_FLAG_REPLY;
  rp.cb.send = sendCallback;
  rp.user_data = ctx;
  void* req = ucp_am_send_nbx(p->ep, id, ctx->header.data(), ctx->header.size(), data, length, &rp);
  if (req == nullptr) {
    onSendDone(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    onSendDone(ctx, UCS_PTR_STATUS(req));
  }
}

void UcxAgent::startWrite(const std::shared_ptr<UcxPeer>& p, uint64_t tid,
                          std::shared_ptr<TransferCore> core, std::vector<WriteOp> ops) {
  if (p->lost || p->ep == nullptr) {
    core->complete(Unavailable("peer " + std::to_string(p->id) + " is gone"));
    return;
  }
  struct Resolved {
    const uint8_t* src;
    uint64_t remote_address;
    ucp_rkey_h rkey;
  };
  std::vector<Resolved> resolved;
  resolved.reserve(ops.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      auto l = regions_.find(ops[i].local_region);
      auto r = p->remote_regions.find(ops[i].remote_region);
      if (l == regions_.end() || r == p->remote_regions.end()) {
        core->complete(NotFound("op " + std::to_string(i) +
                                ": a region was deregistered before the write started"));
        return;
      }
      if (p->use_put && r->second.rkey == nullptr) {
        core->complete(Internal("op " + std::to_string(i) + ": no rkey for remote region " +
                                std::to_string(ops[i].remote_region)));
        return;
      }
      resolved.push_back({l->second.region->data() + ops[i].local_offset,
                          r->second.address + ops[i].remote_offset, r->second.rkey});
    }
  }
  OutTransfer& out = p->out[tid];
  out.core = std::move(core);
  out.sends_outstanding = ops.size();
  const uint32_t count = static_cast<uint32_t>(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (p->lost) break;  // markLost failed the transfer; the rest is moot
    if (p->use_put) {
      auto* ctx = new ReqCtx{this, p->id, tid, {}, nullptr};
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = sendCallback;
      rp.user_data = ctx;
      void* req = ucp_put_nbx(p->ep, resolved[i].src, ops[i].bytes, resolved[i].remote_address,
                              resolved[i].rkey, &rp);
      if (req == nullptr) {
        onSendDone(ctx, UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        onSendDone(ctx, UCS_PTR_STATUS(req));
      }
    } else {
      Bytes header;
      putFixed64(header, tid);
      putFixed32(header, count);
      putFixed32(header, ops[i].remote_region);
      putFixed64(header, ops[i].remote_offset);
      putFixed64(header, ops[i].bytes);
      sendAm(p, kAmWrite, std::move(header), resolved[i].src, ops[i].bytes, nullptr, 0, tid);
    }
  }
  if (p->use_put && !p->lost && p->ep != nullptr) {
    auto* ctx = new ReqCtx{this, p->id, tid, {}, nullptr};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = flushCallback;
    rp.user_data = ctx;
    void* req = ucp_ep_flush_nbx(p->ep, &rp);
    if (req == nullptr) {
      onFlushDone(ctx, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      onFlushDone(ctx, UCS_PTR_STATUS(req));
    }
  }
}

void UcxAgent::maybeFinishOut(const std::shared_ptr<UcxPeer>& p, uint64_t tid) {
  auto it = p->out.find(tid);
  if (it == p->out.end()) return;
  OutTransfer& t = it->second;
  if (t.sends_outstanding != 0 || !t.remote_done) return;
  Status s = t.first_error;
  if (s.isOk() && t.core->cancelRequested()) {
    s = Cancelled("transfer cancelled; its in-flight writes finished first");
  }
  t.core->complete(std::move(s));
  p->out.erase(it);
}

void UcxAgent::maybeAckIn(const std::shared_ptr<UcxPeer>& p, uint64_t tid) {
  auto it = p->in.find(tid);
  if (it == p->in.end()) return;
  InTransfer& t = it->second;
  if (t.accounted < t.op_count || t.in_flight != 0) return;
  Bytes header;
  putFixed64(header, tid);
  putFixed32(header, static_cast<uint32_t>(t.first_error.code()));
  auto msg = std::make_shared<std::string>(t.first_error.message());
  p->in.erase(it);
  sendAm(p, kAmWriteAck, std::move(header), msg->data(), msg->size(), msg, UCP_AM_SEND_FLAG_EAGER,
         0);
}

void UcxAgent::deliverMessages(const std::shared_ptr<UcxPeer>& p) {
  for (auto it = p->reorder.find(p->next_recv_seq); it != p->reorder.end();
       it = p->reorder.find(p->next_recv_seq)) {
    pushEvent(Event{Event::Kind::kMessage, p->id, std::move(it->second), OkStatus()});
    p->reorder.erase(it);
    ++p->next_recv_seq;
  }
}

void UcxAgent::onSendDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  if (ctx->transfer == 0) {
    if (st != UCS_OK && st != UCS_ERR_CANCELED) {
      HXFER_LOG_DEBUG("ucx {}: control message to peer {} failed: {}", config_.label, ctx->peer,
                      ucs_status_string(st));
    }
    return;
  }
  auto p = findPeer(ctx->peer);
  if (!p) return;
  auto it = p->out.find(ctx->transfer);
  if (it == p->out.end()) return;
  --it->second.sends_outstanding;
  if (st != UCS_OK) {
    if (it->second.first_error.isOk()) {
      it->second.first_error = ucxError("write to peer " + std::to_string(p->id), st);
    }
    it->second.remote_done = true;  // no ack will come for a write that never left
  }
  maybeFinishOut(p, ctx->transfer);
}

void UcxAgent::onFlushDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  auto p = findPeer(ctx->peer);
  if (!p) return;
  auto it = p->out.find(ctx->transfer);
  if (it == p->out.end()) return;
  it->second.remote_done = true;
  if (st != UCS_OK && it->second.first_error.isOk()) {
    it->second.first_error = ucxError("flush to peer " + std::to_string(p->id), st);
  }
  maybeFinishOut(p, ctx->transfer);
}

void UcxAgent::onRecvDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  auto p = findPeer(ctx->peer);
  if (!p) return;
  auto it = p->in.find(ctx->transfer);
  if (it == p->in.end()) return;
  --it->second.in_flight;
  ++it->second.accounted;
  if (st != UCS_OK && it->second.first_error.isOk()) {
    it->second.first_error = ucxError("receiving a write from peer " + std::to_string(p->id), st);
  }
  maybeAckIn(p, ctx->transfer);
}

ucs_status_t UcxAgent::onAm(unsigned id, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucp_ep_h ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  auto p = peerOfEp(ep);
  if (!p || p->lost) {
    HXFER_LOG_WARN("ucx {}: dropping active message {} from an unknown endpoint", config_.label,
                   id);
    return UCS_OK;  // for rendezvous: the descriptor is dropped
  }
  Decoder d(std::span<const uint8_t>(static_cast<const uint8_t*>(header), header_length));
  auto protocolError = [&](const Status& s) {
    HXFER_LOG_ERROR("ucx {}: bad active message {} from peer {}: {}", config_.label, id, p->id,
                    s.toString());
    markLost(p,
             Unavailable("peer " + std::to_string(p->id) + " broke the protocol: " + s.toString()));
    return UCS_OK;
  };
  switch (id) {
    case kAmHello:
    case kAmHelloAck: {
      uint32_t version = 0;
      Status s = d.getFixed32("hello.version", &version);
      if (s.isOk() && version != kProtocolVersion) {
        s = Incompatible("peer ucx protocol version=" + std::to_string(version) +
                         " != ours=" + std::to_string(kProtocolVersion));
      }
      if (s.isOk() && (id == kAmHello) != p->incoming) s = Corruption("unexpected hello");
      if (!s.isOk()) return protocolError(s);
      decideMode(p);
      if (id == kAmHello) {
        Bytes ack;
        putFixed32(ack, kProtocolVersion);
        sendAm(p, kAmHelloAck, std::move(ack), nullptr, 0, nullptr, UCP_AM_SEND_FLAG_EAGER, 0);
        p->acked = true;
        pushEvent(Event{Event::Kind::kPeerConnected, p->id, {}, OkStatus()});
      } else {
        {
          std::lock_guard<std::mutex> lock(mu_);
          p->acked = true;
        }
        ack_cv_.notify_all();
      }
      return UCS_OK;
    }
    case kAmMessage: {
      uint64_t seq = 0;
      Status s = d.getFixed64("message.seq", &seq);
      if (s.isOk() && (rndv || seq < p->next_recv_seq)) {
        s = Corruption("message seq=" + std::to_string(seq) + " unexpected");
      }
      if (!s.isOk()) return protocolError(s);
      auto* bytes = static_cast<const uint8_t*>(data);
      p->reorder[seq] = std::vector<uint8_t>(bytes, bytes + length);
      deliverMessages(p);
      return UCS_OK;
    }
    case kAmWrite: {
      uint64_t tid = 0, offset = 0, bytes = 0;
      uint32_t count = 0, region = 0;
      Status s = d.getFixed64("write.transfer", &tid);
      if (s.isOk()) s = d.getFixed32("write.op_count", &count);
      if (s.isOk()) s = d.getFixed32("write.region", &region);
      if (s.isOk()) s = d.getFixed64("write.offset", &offset);
      if (s.isOk()) s = d.getFixed64("write.bytes", &bytes);
      if (s.isOk() && count == 0) s = Corruption("write.op_count=0");
      if (!s.isOk()) return protocolError(s);
      InTransfer& t = p->in[tid];
      if (t.op_count == 0) t.op_count = count;
      // The receiver's own terms: the write must fall inside one of OUR registered regions.
      uint8_t* dst = nullptr;
      Status bad = OkStatus();
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = regions_.find(region);
        if (it == regions_.end()) {
          bad = NotFound("incoming write to region id=" + std::to_string(region) +
                         ", which is not registered here");
        } else if (bytes == 0 || bytes != length || !it->second.region->contains(offset, bytes)) {
          bad = InvalidArgument("incoming write offset=" + std::to_string(offset) + " bytes=" +
                                std::to_string(bytes) + " (payload " + std::to_string(length) +
                                ") does not fit region id=" + std::to_string(region) +
                                " length=" + std::to_string(it->second.region->length()));
        } else {
          dst = it->second.region->data() + offset;
        }
      }
      if (count != t.op_count) {
        bad = Corruption("write.op_count=" + std::to_string(count) + " changed within transfer " +
                         std::to_string(tid));
      }
      if (!bad.isOk()) {
        HXFER_LOG_WARN("ucx {}: refusing a write from peer {}: {}", config_.label, p->id,
                       bad.toString());
        if (t.first_error.isOk()) t.first_error = bad.withContext("refused by the receiver");
        ++t.accounted;
        maybeAckIn(p, tid);
        return UCS_OK;  // a rendezvous descriptor is dropped: nothing lands
      }
      if (!rndv) {
        std::memcpy(dst, data, bytes);
        ++t.accounted;
        maybeAckIn(p, tid);
        return UCS_OK;
      }
      auto* ctx = new ReqCtx{this, p->id, tid, {}, nullptr};
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = recvCallback;
      rp.user_data = ctx;
      ++t.in_flight;
      void* req = ucp_am_recv_data_nbx(worker_, data, dst, bytes, &rp);
      if (req == nullptr) {
        onRecvDone(ctx, UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        onRecvDone(ctx, UCS_PTR_STATUS(req));
      }
      return UCS_OK;
    }
    case kAmWriteAck: {
      uint64_t tid = 0;
      uint32_t code = 0;
      Status s = d.getFixed64("write_ack.transfer", &tid);
      if (s.isOk()) s = d.getFixed32("write_ack.status", &code);
      if (s.isOk() && (rndv || code > static_cast<uint32_t>(StatusCode::kInternal))) {
        s = Corruption("write_ack.status=" + std::to_string(code) + " is not a status code");
      }
      if (!s.isOk()) return protocolError(s);
      auto it = p->out.find(tid);
      if (it == p->out.end()) return UCS_OK;  // failed or finished already
      it->second.remote_done = true;
      if (code != 0 && it->second.first_error.isOk()) {
        it->second.first_error = Status(static_cast<StatusCode>(code),
                                        std::string(static_cast<const char*>(data), length));
      }
      maybeFinishOut(p, tid);
      return UCS_OK;
    }
    default:
      return protocolError(Corruption("unknown active message id"));
  }
}

}  // namespace

StatusOr<std::unique_ptr<Agent>> createUcxAgent(const AgentConfig& config) {
  auto agent = std::make_unique<UcxAgent>(config);
  RETURN_IF_ERROR(agent->init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace hxfer::transport

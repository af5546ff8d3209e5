#include "transport/ucx/ucx_transport.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "common/env.h"
#include "common/logging.h"
#include "transport/tag.h"
#include "transport/ucx/ucx_stop_reports.h"

namespace tdx {
namespace transport {

namespace {

const char* kPrefix = "[tdx transport]";

void check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) {
    throw std::runtime_error(std::string("UCX ") + what + " failed: " +
                             ucs_status_string(status) +
                             ". Check UCX_TLS / UCX_NET_DEVICES, or run with UCX_LOG_LEVEL=info");
  }
}

void sendCallback(void* ucxRequest, ucs_status_t status, void* user) {
  auto* r = static_cast<Request*>(user);
  static_cast<UcxTransport*>(r->owner)->onRequestDone(r, ucxRequest, status, nullptr);
}

void recvCallback(void* ucxRequest, ucs_status_t status, const ucp_tag_recv_info_t* info,
                  void* user) {
  auto* r = static_cast<Request*>(user);
  static_cast<UcxTransport*>(r->owner)->onRequestDone(r, ucxRequest, status, info);
}

struct ErrArg {
  UcxTransport* owner;
  int id;
};

void endpointErrorCallback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* a = static_cast<ErrArg*>(arg);
  a->owner->onEndpointError(a->id, status);
}

// A transport address: this tag, the ProcessId's length (4 bytes, little-endian), the
// ProcessId, then UCX's worker address.
constexpr char kAddressTag[4] = {'t', 'd', 'x', 'A'};

std::string frameAddress(const std::string& process, const std::string& ucx) {
  std::string out(kAddressTag, sizeof(kAddressTag));
  const uint32_t n = static_cast<uint32_t>(process.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + process + ucx;
}

// Splits a framed address into the peer's ProcessId and its UCX worker address.
std::pair<ProcessId, std::string> unframeAddress(const std::string& address) {
  const size_t head = sizeof(kAddressTag) + 4;
  if (address.size() < head || address.compare(0, sizeof(kAddressTag), kAddressTag,
                                               sizeof(kAddressTag)) != 0) {
    throw std::invalid_argument("not a tdx transport address (" +
                                std::to_string(address.size()) +
                                " bytes); every rank must run the same torchdist_ext build");
  }
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) {
    n |= static_cast<uint32_t>(static_cast<unsigned char>(address[sizeof(kAddressTag) + i]))
         << (8 * i);
  }
  if (address.size() < head + n) throw std::invalid_argument("truncated tdx transport address");
  return {ProcessId::parse(address.substr(head, n)), address.substr(head + n)};
}

bool envSet(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

// TCP sockets: what a job needs to reach ranks on other hosts, and what exposes each rank
// to anyone who can reach its port (UCX trusts what arrives there: docs/RELIABILITY.md).
// A job whose ranks share this host and can watch each other needs none.
void configureTcp(ucp_config_t* config, bool load) {
  if (!load) {
    // A UCX_TLS of the user's own already leaves TCP out, and stays as it is.
    if (!envSet("UCX_TLS")) {
      check(ucp_config_modify(config, "TLS", "^tcp"), "config (TLS=^tcp)");
    }
    return;
  }
  // UCX writes 8 KiB segments and reads 64 KiB ones by default, which cuts every large
  // message into many system calls; 256 KiB / 1 MiB halved large transfers. A 1 MiB send
  // segment also keeps messages above 512 KiB on UCX's zero-copy rendezvous: with
  // 256 KiB, UCX moved them through bounce buffers ("fragmented copy-in copy-out"), a
  // 64 MiB all_reduce took 47-84 ms instead of 36-39 (docs/PERFORMANCE.md, "Messages
  // over TCP"). Both or neither: UCX refuses a send segment larger than the receive
  // segment, so a user who set one keeps the other.
  if (!envSet("UCX_TCP_TX_SEG_SIZE") && !envSet("UCX_TCP_RX_SEG_SIZE")) {
    check(ucp_config_modify(config, "TCP_TX_SEG_SIZE", "1m"), "config (TCP_TX_SEG_SIZE)");
    check(ucp_config_modify(config, "TCP_RX_SEG_SIZE", "1m"), "config (TCP_RX_SEG_SIZE)");
  }
}

// Whether a UCX_TLS value loads UCX's TCP transport: "^a,b" excludes, "a,b" includes
// ("all" includes everything).
bool tlsIncludesTcp(const std::string& tls) {
  std::vector<std::string> names;
  std::istringstream in(tls);
  for (std::string name; std::getline(in, name, ',');) {
    if (!name.empty()) names.push_back(name);
  }
  if (names.empty()) return true;
  if (names[0][0] == '^') {
    names[0] = names[0].substr(1);
    return std::find(names.begin(), names.end(), "tcp") == names.end();
  }
  return std::find(names.begin(), names.end(), "tcp") != names.end() ||
         std::find(names.begin(), names.end(), "all") != names.end();
}

// Between ranks of one host UCX sends messages from about 8 KiB up by rendezvous: the
// receiver copies the data straight out of the sender (CMA) once both have exchanged a
// handshake. That saves a copy while every rank has a core, but when ranks outnumber the
// cores each handshake waits for a descheduled peer, and a pipelined op (a chain
// broadcast of 256 KiB chunks, halving-doubling's small steps) pays that per step. Then
// messages up to 1 MiB go eagerly through the shared-memory FIFOs instead, which the
// sender fills without waiting (docs/PERFORMANCE.md, "Point-to-point and message
// algorithms on one host"). UCX has one threshold for all its transports, so a job
// whose hosts are oversubscribed uses it between hosts too.
// Returns the threshold set, or "" when UCX keeps its own.
std::string configureRendezvous(ucp_config_t* config, int localRanks, int localCpus) {
  if (envSet("UCX_RNDV_THRESH")) return "";
  if (localRanks <= localCpus) return "";
  check(ucp_config_modify(config, "RNDV_THRESH", "1m"), "config (RNDV_THRESH)");
  return "1m";
}

UcxTransport::PeerErrors peerErrorsSetting() {
  const std::string v = env::get("TDX_UCX_PEER_ERRORS");
  if (v == "auto") return UcxTransport::PeerErrors::Unwatched;
  if (v == "1") return UcxTransport::PeerErrors::Always;
  if (v == "0") return UcxTransport::PeerErrors::Never;
  throw std::invalid_argument("TDX_UCX_PEER_ERRORS=" + v + " is not one of auto, 1, 0");
}

std::mutex gInstanceMu;
std::weak_ptr<UcxTransport> gInstance;

// Teardowns moved off the progress thread (see acquire()). Counted so that a new
// transport waits for the old one to finish closing, and process exit waits for them
// before UCX's own library destructors run; both waits are bounded.
struct Teardowns {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;

  bool waitIdle(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return pending == 0; });
  }
  void done() {
    {
      std::lock_guard<std::mutex> lock(mu);
      --pending;
    }
    cv.notify_all();
  }
  ~Teardowns() {
    waitIdle(std::chrono::seconds(5));
  }
};

Teardowns& teardowns() {
  static Teardowns t;
  return t;
}

} // namespace

std::shared_ptr<UcxTransport> UcxTransport::acquire(const Hints& hints) {
  std::lock_guard<std::mutex> lock(gInstanceMu);
  auto t = gInstance.lock();
  if (!t) {
    Teardowns& td = teardowns();
    if (!td.waitIdle(std::chrono::seconds(5))) {
      TDX_LOG(Warn, kPrefix) << "the previous UCX transport is still closing after 5 s; "
                                "starting a new one beside it";
    }
    // The last reference can go away on the progress thread itself: a completion callback
    // that outlived its process group holds one, and the progress thread destroys the
    // callback once it has run. The destructor joins that thread, which a thread cannot do
    // to itself (std::terminate), so there the teardown moves to a thread of its own.
    t = std::shared_ptr<UcxTransport>(new UcxTransport(hints), [](UcxTransport* p) {
      if (std::this_thread::get_id() != p->progressThread_.get_id()) {
        delete p;
        return;
      }
      Teardowns& td = teardowns();
      {
        std::lock_guard<std::mutex> lock(td.mu);
        ++td.pending;
      }
      try {
        std::thread([p, &td] {
          delete p;
          td.done();
        }).detach();
      } catch (const std::system_error&) {
        // No thread to be had: leave the transport to the process's exit.
        td.done();
      }
    });
    gInstance = t;
  }
  return t;
}

bool UcxTransport::chooseTcp(bool tcpWanted) const {
  if (envSet("UCX_TLS")) return tlsIncludesTcp(std::getenv("UCX_TLS"));  // the user's choice
  const std::string mode = env::get("TDX_UCX_TCP");
  if (mode == "1") return true;
  if (mode == "0") return false;
  if (mode != "auto") {
    throw std::invalid_argument("TDX_UCX_TCP=" + mode + " is not one of auto, 1, 0");
  }
  // Without TCP a dead peer is noticed only through its pidfd, so every peer must be
  // watchable: same host (the caller's word) and a kernel with pidfd_open.
  return tcpWanted || peerErrors_ == PeerErrors::Always || !ProcessWatch::supported() ||
         self_.startTime == 0;  // /proc hides it: peers could not check this process
}

UcxTransport::UcxTransport(const Hints& hints)
    : self_(ProcessId::self()), spin_(env::getInt("TDX_SPIN_US")),
      peerErrors_(peerErrorsSetting()) {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "config read");
  try {
    tcpLoaded_ = chooseTcp(hints.tcpWanted);
    configureTcp(config, tcpLoaded_);
    rendezvousThreshold_ = configureRendezvous(config, hints.localRanks, hints.localCpus);
  } catch (...) {
    ucp_config_release(config);
    throw;
  }
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_TAG_SENDER_MASK |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.tag_sender_mask = tag::kRankFieldMask;
  params.mt_workers_shared = 1;
  ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check(st, "context init");
  try {
    startWorker();
  } catch (...) {
    // The destructor does not run for a constructor that throws.
    if (epollFd_ >= 0) ::close(epollFd_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw;
  }
  progressThread_ = std::thread([this] { progressLoop(); });
  TDX_LOG(Info, logPrefix()) << "UCX " << ucp_get_version_string() << " worker up, "
                             << env::describe();
}

void UcxTransport::startWorker() {
  ucs_status_t st;
  ucp_worker_params_t wp;
  std::memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    check(st, "worker create");
  }

  ucp_worker_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS | UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  check(ucp_worker_query(worker_, &attr), "worker query");
  multiThreaded_ = attr.thread_mode == UCS_THREAD_MODE_MULTI;
  if (!multiThreaded_) {
    // The progress thread, waiters and the groups' threads all call into the worker.
    ucp_worker_release_address(worker_, attr.address);
    throw std::runtime_error(
        "the UCX worker is not multi-threaded (thread mode " + std::to_string(attr.thread_mode) +
        "): this UCX build lacks --enable-mt, which tdx needs. Use the libucx-cu13 wheel "
        "or a UCX built with --enable-mt");
  }
  address_ = frameAddress(self_.serialize(),
                         std::string(reinterpret_cast<const char*>(attr.address),
                                     attr.address_length));
  ucp_worker_release_address(worker_, attr.address);

  check(ucp_worker_get_efd(worker_, &eventFd_), "worker event fd");
  epollFd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epollFd_ < 0) {
    throw std::runtime_error(std::string("epoll_create1 failed: ") + std::strerror(errno));
  }
  epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = EPOLLIN;
  ev.data.fd = eventFd_;
  if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, eventFd_, &ev) != 0) {
    throw std::runtime_error(std::string("epoll_ctl failed: ") + std::strerror(errno));
  }
  // Watched peers' exits wake the progress thread too.
  if (watch_.fd() >= 0) {
    ev.data.fd = watch_.fd();
    if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, watch_.fd(), &ev) != 0) {
      throw std::runtime_error(std::string("epoll_ctl failed: ") + std::strerror(errno));
    }
  }

}

UcxTransport::~UcxTransport() {
  // Cancel whatever is still in flight and give UCX a bounded time to report it, then
  // close endpoints. No store traffic and no unbounded waits here.
  std::vector<RequestPtr> live;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    for (auto& kv : inflight_) live.push_back(kv.second);
  }
  for (auto& r : live) cancel(*r, "transport shut down");
  // Receives get 2 s: a cancelled one ends at once, a matched one from a live peer in a
  // moment. A send still in flight here belongs to an op that failed or was given up on,
  // or to a peer whose goodbye this rank stopped waiting for (a healthy group's sends end
  // before its goodbyes are exchanged), and UCX cannot cancel one that the peer never
  // takes (acknowledged, or a rendezvous): 100 ms.
  const auto start = Clock::now();
  const auto until = start + std::chrono::seconds(2);
  const auto sendsUntil = start + std::chrono::milliseconds(100);
  while (Clock::now() < until) {
    progressOnce();
    // Requests already failed by a lost watched peer may never hear back from UCX.
    const bool sendsCount = Clock::now() < sendsUntil;
    std::lock_guard<std::mutex> lock(inflightMu_);
    bool open = false;
    for (auto& kv : inflight_) {
      open = open || (!kv.second->done() && (sendsCount || !kv.second->isSend));
    }
    if (!open) break;
  }
  closeEndpoints();
  stop_ = true;
  wake();
  if (progressThread_.joinable()) progressThread_.join();
  drain();
  {
    std::lock_guard<std::mutex> lock(closingMu_);
    auto limit = Clock::now() + std::chrono::seconds(1);
    for (auto& [req, endpoint] : forceClosing_) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < limit) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(req);
    }
    forceClosing_.clear();
  }
  if (epollFd_ >= 0) ::close(epollFd_);
  {
    // UCX's own reports of what the worker still holds, one line per object, are shown
    // at TDX_DEBUG=DETAIL; otherwise they are counted into one line here.
    std::optional<StopReportsCounter> counter;
    if (!logEnabled(LogLevel::Detail)) counter.emplace();
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    if (counter && counter->counts().total() > 0) {
      const auto& c = counter->counts();
      TDX_LOG(Info, logPrefix())
          << "stopped with " << c.objects << " UCX request(s) or buffer(s) in use, "
          << c.regions << " registered region(s) in use and " << c.messages
          << " message(s) never received (transfers given up on after a failure, or sent "
             "and never received); TDX_DEBUG=DETAIL shows UCX's report of each";
    }
  }
  // What requests UCX had not let go of still hold goes with inflight_, except a
  // receive's from a peer that may be alive: its process may still write into the
  // buffer (a rendezvous by put through CMA needs only this process's pid), so that is
  // kept, and counted, for the life of the process. A send's buffer is only read.
  static auto* kept = new std::vector<std::shared_ptr<const void>>();
  static std::mutex keptMu;
  std::lock_guard<std::mutex> inflightLock(inflightMu_);
  for (auto& [raw, r] : inflight_) {
    if (r->isSend || (r->endpoint >= 0 && endpointFailed(r->endpoint))) continue;
    auto held = r->releaseHeld();
    std::lock_guard<std::mutex> lock(keptMu);
    kept->insert(kept->end(), std::make_move_iterator(held.begin()),
                 std::make_move_iterator(held.end()));
  }
}

void UcxTransport::closeEndpoints() {
  // A send UCX still holds now (see the destructor) may never end: an acknowledged send
  // the peer never takes, a rendezvous whose peer never reads. A flushing close waits
  // for it, so an endpoint with one gets a short flush instead of the usual 2 s.
  std::unordered_set<int> stuck;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    for (auto& kv : inflight_) {
      if (kv.second->isSend) stuck.insert(kv.second->endpoint);
    }
  }
  // Taken out under the lock, closed outside it (see the lock order above connect()).
  struct Closing {
    ucp_ep_h ep;
    bool failed;
    bool stuck;
  };
  std::vector<Closing> eps;
  {
    std::lock_guard<std::mutex> lock(endpointsMu_);
    for (auto& e : endpoints_) {
      if (e.ep == nullptr) continue;
      eps.push_back({e.ep, e.failed.load(), stuck.count(e.id) > 0});
      e.ep = nullptr;
    }
  }
  const auto now = Clock::now();
  std::vector<std::pair<void*, Clock::time_point>> closing;
  for (const auto& c : eps) {
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A flushing close lets in-flight eager data drain to a live peer; a peer already
    // reported lost gets a forced close.
    p.flags = c.failed ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(c.ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
      closing.emplace_back(req, now + (c.stuck ? std::chrono::milliseconds(100)
                                               : std::chrono::milliseconds(2000)));
    }
  }
  for (auto& [req, until] : closing) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(req);
  }
}

std::string UcxTransport::address() const {
  return address_;
}

// Lock order: UCX calls our callbacks (onEndpointError, completions) while holding its
// worker lock, and they take endpointsMu_ / inflightMu_. So no thread may call into UCX
// while holding those mutexes, or a peer closing its side during a connect deadlocks the
// two (seen with repeated init/destroy). connectMu_ alone serialises connects.
int UcxTransport::connect(const std::string& address) {
  std::lock_guard<std::mutex> serial(connectMu_);
  const auto [peer, ucxAddress] = unframeAddress(address);
  int id = 0;
  {
    std::lock_guard<std::mutex> lock(endpointsMu_);
    auto it = endpointByAddress_.find(address);
    if (it != endpointByAddress_.end() && !endpoints_[it->second].failed) {
      return it->second;
    }
    id = static_cast<int>(endpoints_.size());
    endpoints_.emplace_back();  // a deque: references to older entries stay valid
    endpoints_.back().owner = this;
    endpoints_.back().id = id;
    endpoints_.back().pid = peer.pid;  // before the watch below can report its exit
  }
  // Leaked on purpose: UCX may call the error handler until the worker is destroyed.
  auto* arg = new ErrArg{this, id};

  ucp_ep_params_t ep;
  std::memset(&ep, 0, sizeof(ep));
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(ucxAddress.data());
  // Peer error handling is what turns a dead peer into an error instead of a hang, but
  // UCX's shared-memory transports cannot provide it, so with it every intra-node byte
  // goes over TCP loopback. A peer on this host is watched through its pidfd instead,
  // which lets UCX use shared memory (TDX_UCX_PEER_ERRORS=auto).
  // This process's own endpoint can never lose its peer, and UCX's loopback transport
  // has no peer error handling to give.
  const bool self = peer.pid == self_.pid && peer.sameHostAs(self_);
  const bool watched = !self && watch_.watch(id, peer);
  const bool peerMode = !self && (peerErrors_ == PeerErrors::Always ||
                                  (peerErrors_ == PeerErrors::Unwatched && !watched));
  ep.err_mode = peerMode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = endpointErrorCallback;
  ep.err_handler.arg = arg;
  ucp_ep_h handle = nullptr;
  const ucs_status_t created = ucp_ep_create(worker_, &ep, &handle);
  if (created != UCS_OK) {
    // The entry stays (ids index a deque) but is failed: nothing posts on it, a later
    // connect to the address makes a new one, and the watch's exit report is ignored.
    std::lock_guard<std::mutex> lock(endpointsMu_);
    endpoints_[id].failed = true;
    endpoints_[id].failure = std::string("endpoint create: ") + ucs_status_string(created);
  }
  if (created != UCS_OK && !self && peer.sameHostAs(self_) &&
      processStartTime(peer.pid) != peer.startTime) {
    // UCX's own words ("Shared memory error") point at its settings, but the address
    // names a process of this host that is gone: its record outlived it in the store.
    throw std::runtime_error(
        std::string("UCX endpoint create failed (") + ucs_status_string(created) +
        "): the address the peer published belongs to process " + std::to_string(peer.pid) +
        " on this host, which is no longer running: that rank has exited since it "
        "published it (see its own error)");
  }
  check(created, "endpoint create");
  {
    std::lock_guard<std::mutex> lock(endpointsMu_);
    endpoints_[id].ep = handle;
    endpoints_[id].watched = watched;
    endpoints_[id].sameHost = peer.sameHostAs(self_);
    endpoints_[id].peerErrors = peerMode;
    endpointByAddress_[address] = id;
  }
  TDX_LOG(Info, logPrefix()) << "endpoint " << id << " to pid " << peer.pid
                             << (peer.sameHostAs(self_) ? " on this host" : " on another host")
                             << (watched ? ", process watched" : "")
                             << (peerMode ? ", UCX peer errors" : "");
  return id;
}

std::shared_ptr<UcxTransport> UcxTransport::current() {
  std::lock_guard<std::mutex> lock(gInstanceMu);
  return gInstance.lock();
}

std::vector<UcxTransport::EndpointInfo> UcxTransport::endpointInfo() const {
  std::lock_guard<std::mutex> lock(endpointsMu_);
  std::vector<EndpointInfo> out;
  for (const auto& e : endpoints_) {
    // `watched` stays true after the exit was seen; `failed` tells that apart.
    out.push_back({e.id, e.pid, e.sameHost, e.watched, e.peerErrors, e.failed.load()});
  }
  return out;
}

bool UcxTransport::endpointFailed(int endpoint) const {
  if (endpoint < 0) return false;
  std::lock_guard<std::mutex> lock(endpointsMu_);
  return endpoints_[endpoint].failed.load();
}

RequestPtr UcxTransport::track(int endpoint, bool isSend,
                               std::function<void(Request&)> onComplete) {
  auto r = std::make_shared<Request>();
  r->owner = this;
  r->endpoint = endpoint;
  r->isSend = isSend;
  r->onComplete = std::move(onComplete);
  std::lock_guard<std::mutex> lock(inflightMu_);
  inflight_[r.get()] = r;
  return r;
}

void UcxTransport::finishRequest(Request& r, bool ok, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.done()) return;
    if (!ok && r.error.empty()) r.error = error;
    r.state.store(ok ? Request::State::Ok : Request::State::Failed, std::memory_order_release);
  }
  r.cv.notify_all();
}

void UcxTransport::finishImmediately(const RequestPtr& r, ucs_status_t status, size_t length,
                                     uint64_t senderTag) {
  r->receivedBytes = length;
  r->senderTag = senderTag;
  r->retired = true;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    inflight_.erase(r.get());
  }
  finishRequest(*r, status == UCS_OK, ucs_status_string(status));
  r->runOnComplete();
}

void UcxTransport::onRequestDone(Request* r, void* ucxRequest, ucs_status_t status,
                                 const ucp_tag_recv_info_t* info) {
  r->handle.store(ucxRequest);
  if (info != nullptr) {
    // A request already ended (abandoned) may have its completion reading these.
    std::lock_guard<std::mutex> lock(r->mu);
    if (!r->done()) {
      r->receivedBytes = info->length;
      r->senderTag = info->sender_tag;
    }
  }
  std::string error;
  if (status == UCS_ERR_MESSAGE_TRUNCATED) {
    {
      // Before finishRequest publishes the state; not once another path ended it.
      std::lock_guard<std::mutex> lock(r->mu);
      if (!r->done()) r->truncated = true;
    }
    error = "message longer than the receive buffer (the peer sent more bytes than this "
            "rank expected: the ranks disagree on tensor sizes)";
  } else if (status != UCS_OK) {
    error = ucs_status_string(status);
  }
  finishRequest(*r, status == UCS_OK, error);
  // Freeing and user hooks happen outside UCX's callback context.
  defer([this, r] {
    RequestPtr keep;
    {
      std::lock_guard<std::mutex> lock(inflightMu_);
      auto it = inflight_.find(r);
      if (it == inflight_.end()) return;
      keep = std::move(it->second);
      inflight_.erase(it);
    }
    if (void* h = keep->handle.load()) ucp_request_free(h);
    keep->retired = true;
    keep->runOnComplete();
  });
}

std::string UcxTransport::logPrefix() const {
  const int64_t rank = rank_.load(std::memory_order_relaxed);
  return rank < 0 ? std::string(kPrefix) : "[tdx r" + std::to_string(rank) + " transport]";
}

void UcxTransport::setPeerRank(int endpoint, int64_t rank) {
  std::lock_guard<std::mutex> lock(endpointsMu_);
  endpoints_.at(endpoint).rank = rank;
}

void UcxTransport::onEndpointError(int endpoint, ucs_status_t status) {
  failEndpoint(endpoint, ucs_status_string(status));
}

void UcxTransport::failEndpoint(int endpoint, const std::string& failure) {
  std::string why;
  std::string peer;  // for the log: which process this endpoint reached
  bool forceClose = false;
  {
    std::lock_guard<std::mutex> lock(endpointsMu_);
    Endpoint& e = endpoints_[endpoint];
    if (e.failed.exchange(true)) return;
    failedEndpoints_.fetch_add(1, std::memory_order_release);
    e.failure = failure;
    why = e.failure;
    forceClose = e.watched && !e.peerErrors;
    const std::string where = "pid " + std::to_string(e.pid) +
                              (e.sameHost ? " on this host)" : " on another host)");
    peer = e.rank >= 0 ? "rank " + std::to_string(e.rank) + " (endpoint " +
                             std::to_string(endpoint) + ", " + where
                       : "endpoint " + std::to_string(endpoint) + " (" + where;
  }
  // A peer that shut down cleanly closes its side too; that is only worth a warning
  // when something was still waiting on it.
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    for (auto& kv : inflight_) {
      busy = busy || (kv.second->endpoint == endpoint && !kv.second->background.load());
    }
  }
  if (busy) {
    TDX_LOG(Warn, logPrefix()) << "lost connection to " << peer << ": " << why;
  } else {
    TDX_LOG(Info, logPrefix()) << peer << " closed by its peer: " << why;
  }
  // Sends on the endpoint complete with an error by themselves (peer error mode), or
  // when a watched peer's endpoint is closed by force below; receives are posted on the
  // worker, so cancel the ones waiting on this peer.
  defer([this, endpoint, why, forceClose] {
    const std::string lost = "connection to peer lost (" + why + ")";
    std::vector<RequestPtr> recvs, sends;
    {
      std::lock_guard<std::mutex> lock(inflightMu_);
      for (auto& kv : inflight_) {
        if (kv.second->endpoint == endpoint) {
          (kv.second->isSend ? sends : recvs).push_back(kv.second);
        }
      }
    }
    for (auto& r : recvs) {
      {
        std::lock_guard<std::mutex> lock(r->mu);
        if (r->error.empty()) r->error = lost;
      }
      if (!r->done() && !r->retired) {
        if (void* h = r->handle.load()) ucp_request_cancel(worker_, h);
      }
    }
    {
      std::lock_guard<std::mutex> lock(closingMu_);
      recvSweeps_.emplace_back(endpoint, Clock::now() + kRecvSweepGrace);
    }
    if (!forceClose) return;
    // Sends the force close cancels should say why, not just "canceled".
    for (auto& r : sends) {
      std::lock_guard<std::mutex> lock(r->mu);
      if (r->error.empty()) r->error = lost;
    }
    ucp_ep_h handle = nullptr;
    bool closed = false;  // the force close completed at once
    {
      // Exclusive: no isend is between its check of `failed` and its post (it posts on
      // the handle, which the close frees); later ones find no handle. The close itself
      // comes after, so this lock is never held across a call into UCX.
      std::unique_lock<std::shared_mutex> posting(postMu_);
      std::lock_guard<std::mutex> lock(endpointsMu_);
      std::swap(handle, endpoints_[endpoint].ep);
    }
    if (handle != nullptr) {
      ucp_request_param_t p;
      std::memset(&p, 0, sizeof(p));
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* req = ucp_ep_close_nbx(handle, &p);
      if (UCS_PTR_IS_PTR(req)) {
        std::lock_guard<std::mutex> lock(closingMu_);
        forceClosing_.emplace_back(req, endpoint);
      } else {
        closed = true;
      }
    }
    // Without peer error handling UCX keeps no list of an endpoint's sends that wait for
    // the peer (a rendezvous waiting for its acknowledgement), so the force close may
    // leave them pending forever. They fail here; the UCX request stays tracked until
    // UCX lets go of it, since it still points at the Request. Looked up again after the
    // close: a send posted since the first look is among them now.
    failPending(endpoint, /*sends=*/true, lost);
    if (closed) releaseSends(endpoint);  // else once the close completes (checkWatched)
  });
  wake();
}

RequestPtr UcxTransport::isend(int endpoint, uint64_t tag, const void* data, size_t bytes,
                               MemType mem, std::function<void(Request&)> onComplete,
                               bool acknowledged) {
  RequestPtr r = track(endpoint, true, std::move(onComplete));
  r->postedBytes = bytes;
  // Shared: a force close of this endpoint waits until the post is done. The exclusive
  // holder calls no UCX function, so this lock never orders against UCX's own.
  std::shared_lock<std::shared_mutex> posting(postMu_);
  ucp_ep_h ep;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(endpointsMu_);
    Endpoint& e = endpoints_.at(endpoint);
    ep = e.ep;
    if (e.failed || ep == nullptr) failure = e.failure.empty() ? "endpoint closed" : e.failure;
  }
  if (!failure.empty()) {
    // Completions run with no transport lock held: one that drives progress() could run
    // a force close, which takes postMu_ exclusively.
    posting.unlock();
    {
      std::lock_guard<std::mutex> lock(r->mu);
      r->error = "connection to peer lost (" + failure + ")";
    }
    finishImmediately(r, UCS_ERR_CONNECTION_RESET, 0, 0);
    return r;
  }
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send = sendCallback;
  p.user_data = r.get();
  p.datatype = ucp_dt_make_contig(1);
  p.memory_type = mem == MemType::Cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucs_status_ptr_t s = acknowledged ? ucp_tag_send_sync_nbx(ep, data, bytes, tag, &p)
                                    : ucp_tag_send_nbx(ep, data, bytes, tag, &p);
  if (s != nullptr && !UCS_PTR_IS_ERR(s)) {
    r->handle.store(s);  // before a force close of the endpoint may look for it
    posting.unlock();
    wake();
    return r;
  }
  posting.unlock();  // the completion below runs with no transport lock held
  if (s == nullptr) {
    finishImmediately(r, UCS_OK, bytes, tag);
  } else {
    finishImmediately(r, UCS_PTR_STATUS(s), 0, 0);
  }
  return r;
}

RequestPtr UcxTransport::irecv(int endpoint, uint64_t tag, uint64_t tagMask, void* data,
                               size_t bytes, MemType mem,
                               std::function<void(Request&)> onComplete) {
  RequestPtr r = track(endpoint, false, std::move(onComplete));
  r->postedBytes = bytes;
  if (endpoint >= 0 && endpointFailed(endpoint)) {
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(endpointsMu_);
      failure = endpoints_.at(endpoint).failure;
    }
    {
      std::lock_guard<std::mutex> lock(r->mu);
      r->error = "connection to peer lost (" + failure + ")";
    }
    finishImmediately(r, UCS_ERR_CONNECTION_RESET, 0, 0);
    return r;
  }
  ucp_tag_recv_info_t info;
  std::memset(&info, 0, sizeof(info));
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE |
                   UCP_OP_ATTR_FIELD_RECV_INFO;
  p.cb.recv = recvCallback;
  p.user_data = r.get();
  p.datatype = ucp_dt_make_contig(1);
  p.memory_type = mem == MemType::Cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  p.recv_info.tag_info = &info;
  // A message too long for the buffer, found already waiting, fails at once, and UCX
  // then says nothing of who sent it. An any-source receive has no other way to learn
  // that, so its completion always comes through the callback, which is told.
  if (endpoint < 0) p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  ucs_status_ptr_t s = ucp_tag_recv_nbx(worker_, data, bytes, tag, tagMask, &p);
  if (s == nullptr) {
    finishImmediately(r, UCS_OK, info.length, info.sender_tag);
  } else if (UCS_PTR_IS_ERR(s)) {
    ucs_status_t st = UCS_PTR_STATUS(s);
    if (st == UCS_ERR_MESSAGE_TRUNCATED) {
      std::lock_guard<std::mutex> lock(r->mu);
      r->truncated = true;
      r->error = "message longer than the receive buffer (the ranks disagree on tensor sizes)";
    }
    finishImmediately(r, st, 0, 0);
  } else {
    r->handle.store(s);
    if (r->done()) {
      // Completed inside the post (an any-source receive whose message was waiting): its
      // completion is queued; run it here, as an immediate completion would have been,
      // rather than leave it to the progress thread's next round.
      drain();
      return r;
    }
    // The peer may have been declared lost between the check above and the store, when
    // its clean-up found no handle to cancel.
    if (endpoint >= 0 && endpointFailed(endpoint)) {
      cancel(*r, "connection to peer lost");
      std::lock_guard<std::mutex> lock(closingMu_);  // in case UCX had matched it already
      recvSweeps_.emplace_back(endpoint, Clock::now() + kRecvSweepGrace);
    }
    wake();
  }
  return r;
}

bool UcxTransport::probe(uint64_t tag, uint64_t tagMask, uint64_t& found) {
  // remove=0: UCX only looks at its queue of unexpected messages, which the progress
  // thread fills; the message is received later as usual (or reported at stop).
  ucp_tag_recv_info_t info;
  if (ucp_tag_probe_nb(worker_, tag, tagMask, /*remove=*/0, &info) == nullptr) return false;
  found = info.sender_tag;
  return true;
}

bool UcxTransport::wait(Request& r, Clock::time_point deadline) {
  auto spinEnd = Clock::now() + spin_;
  while (!r.done()) {
    auto now = Clock::now();
    if (now >= deadline) return r.done();
    if (now < spinEnd) {
      progressOnce();
      continue;
    }
    std::unique_lock<std::mutex> lock(r.mu);
    r.cv.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(5)),
                    [&] { return r.done(); });
  }
  return true;
}

void UcxTransport::cancel(Request& r, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.done()) return;
    if (r.error.empty()) r.error = reason;
  }
  // The request is held from here, not looked up by address when the action runs: by
  // then it may have completed and been freed, and a new request may have its address.
  RequestPtr keep;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    auto it = inflight_.find(&r);
    if (it == inflight_.end()) return;
    keep = it->second;
  }
  defer([this, keep] {
    // Still tracked means UCX still owns the handle. UCX is called without inflightMu_
    // held: its callbacks take that lock under UCX's worker lock. A request that ended on
    // this side only (abandoned at shutdown, failed for a lost peer) is still posted in
    // UCX and is cancelled too: left posted, it could take a message meant for a later
    // group. UCX ignores a cancel of a request it has completed.
    {
      std::lock_guard<std::mutex> lock(inflightMu_);
      auto it = inflight_.find(keep.get());
      if (it == inflight_.end() || it->second != keep) return;
    }
    if (void* h = keep->handle.load()) ucp_request_cancel(worker_, h);
  });
  wake();
}

void UcxTransport::abandon(Request& r, const std::string& reason) {
  if (r.done()) return;
  // Before the completion runs: it must see that the buffer is UCX's for good.
  r.orphaned.store(true);
  finishRequest(r, false, reason);
  runCompletionGuarded(r);
}

void UcxTransport::runCompletionGuarded(Request& r) {
  // Called on the worker and progress threads, outside any try of theirs: a completion
  // that throws (no thread left for what it hands off, say) must not end the process.
  try {
    r.runOnComplete();
  } catch (const std::exception& e) {
    TDX_LOG(Error, kPrefix) << "a request's completion failed: " << e.what();
  } catch (...) {
    TDX_LOG(Error, kPrefix) << "a request's completion failed";
  }
}

void UcxTransport::defer(std::function<void()> action) {
  std::lock_guard<std::mutex> lock(queueMu_);
  queue_.push_back(std::move(action));
}

void UcxTransport::runDeferred() {
  for (;;) {
    std::vector<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lock(queueMu_);
      if (queue_.empty()) return;
      batch.swap(queue_);
    }
    for (auto& action : batch) {
      // Actions complete other threads' requests: one that throws (no thread left for a
      // completion, say) must not drop the rest of the batch, nor reach a user's wait()
      // that merely lent its thread.
      try {
        action();
      } catch (const std::exception& e) {
        TDX_LOG(Error, logPrefix()) << "a deferred transport action failed: " << e.what();
      } catch (...) {
        TDX_LOG(Error, logPrefix()) << "a deferred transport action failed";
      }
    }
  }
}

void UcxTransport::drain() {
  for (;;) {
    {
      std::unique_lock<std::mutex> drainLock(drainMu_, std::try_to_lock);
      if (!drainLock.owns_lock()) return;  // another thread is draining (or we are nested)
      runDeferred();
    }
    // An action queued by a thread that found the lock taken just before it was let go
    // would wait for the next progress round (the progress thread may be asleep): look
    // again now that the lock is free.
    std::lock_guard<std::mutex> lock(queueMu_);
    if (queue_.empty()) return;
  }
}

unsigned UcxTransport::progressOnce() {
  unsigned n = ucp_worker_progress(worker_);
  drain();
  return n;
}

void UcxTransport::wake() {
  if (sleeping_.load(std::memory_order_acquire)) ucp_worker_signal(worker_);
}

void UcxTransport::noteExitedPeers() {
  for (int id : watch_.exited()) {
    int64_t pid = 0;
    {
      std::lock_guard<std::mutex> lock(endpointsMu_);
      pid = endpoints_[id].pid;
    }
    failEndpoint(id, "process " + std::to_string(pid) + " on this host exited");
  }
}

void UcxTransport::checkWatched() {
  noteExitedPeers();
  sweepLostReceives();
  std::vector<int> closed;
  {
    std::lock_guard<std::mutex> lock(closingMu_);
    for (size_t i = 0; i < forceClosing_.size();) {
      if (ucp_request_check_status(forceClosing_[i].first) == UCS_INPROGRESS) {
        ++i;
        continue;
      }
      ucp_request_free(forceClosing_[i].first);
      closed.push_back(forceClosing_[i].second);
      forceClosing_[i] = forceClosing_.back();
      forceClosing_.pop_back();
    }
  }
  for (int endpoint : closed) releaseSends(endpoint);
}

void UcxTransport::sweepLostReceives() {
  std::vector<int> due;
  {
    std::lock_guard<std::mutex> lock(closingMu_);
    const auto now = Clock::now();
    for (size_t i = 0; i < recvSweeps_.size();) {
      if (recvSweeps_[i].second > now) {
        ++i;
        continue;
      }
      due.push_back(recvSweeps_[i].first);
      recvSweeps_[i] = recvSweeps_.back();
      recvSweeps_.pop_back();
    }
  }
  for (int endpoint : due) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(endpointsMu_);
      why = endpoints_[endpoint].failure;
    }
    failPending(endpoint, /*sends=*/false,
                "connection to peer lost (" + why + ") part way through a message");
  }
}

void UcxTransport::failPending(int endpoint, bool sends, const std::string& why) {
  std::vector<RequestPtr> pending;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    for (auto& kv : inflight_) {
      const Request& r = *kv.second;
      // A receive without a handle is being posted right now; its post looks at the
      // endpoint again and cancels it.
      if (r.endpoint == endpoint && r.isSend == sends && !r.done() &&
          (sends || r.handle.load() != nullptr)) {
        pending.push_back(kv.second);
      }
    }
  }
  // Failed here, the UCX request stays tracked (it still points at the Request) until
  // UCX lets go of it. A receive's buffer may still be UCX's: it is orphaned. Nothing
  // more can arrive for it, its sender being gone.
  for (auto& r : pending) {
    if (!sends) r->orphaned.store(true);
    finishRequest(*r, false, why);
    runCompletionGuarded(*r);
  }
}

void UcxTransport::releaseSends(int endpoint) {
  // A send's buffer is only read by the peer (a rendezvous) or by the endpoint's lanes,
  // and after a force close neither is left: the sends failPending ends give their
  // buffers back to their callers on that ground too. The requests stay tracked, as UCX
  // may still point at them; only what they hold goes.
  std::vector<std::shared_ptr<const void>> held;
  {
    std::lock_guard<std::mutex> lock(inflightMu_);
    for (auto& kv : inflight_) {
      Request& r = *kv.second;
      if (r.endpoint != endpoint || !r.isSend || !r.done()) continue;
      // A hold its completion attaches later goes at once.
      for (auto& h : r.releaseHeld()) held.push_back(std::move(h));
    }
  }
  // `held` goes here, outside the locks: the last reference frees tensors.
}

void UcxTransport::progressLoop() {
  auto lastActivity = Clock::now();
  // A busy worker never sleeps on the epoll set, so exits are looked for every 10 ms too.
  auto nextWatch = lastActivity;
  while (!stop_.load()) {
    if (progressOnce() != 0) {
      lastActivity = Clock::now();
      if (lastActivity >= nextWatch) {
        checkWatched();
        nextWatch = lastActivity + std::chrono::milliseconds(10);
      }
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(queueMu_);
      if (!queue_.empty()) continue;
    }
    if (Clock::now() - lastActivity < spin_) {
      std::this_thread::yield();
      continue;
    }
    sleeping_.store(true, std::memory_order_release);
    ucs_status_t st = ucp_worker_arm(worker_);
    bool queued = false;
    {
      // An action queued after the check above by a thread that saw sleeping_ still false
      // sent no signal: look once more, now that a later one would.
      std::lock_guard<std::mutex> lock(queueMu_);
      queued = !queue_.empty();
    }
    if (st == UCS_OK && !queued && !stop_.load()) {
      bool pending = false;
      {
        // Requests failed for a lost watched peer may stay tracked for good: they do not
        // count.
        std::lock_guard<std::mutex> lock(inflightMu_);
        for (auto& kv : inflight_) pending = pending || !kv.second->done();
      }
      epoll_event ev;
      // With requests in flight a short timeout bounds the cost of any transport that
      // cannot raise events; idle workers sleep longer.
      epoll_wait(epollFd_, &ev, 1, pending ? 1 : 100);
    }
    sleeping_.store(false, std::memory_order_release);
    lastActivity = Clock::now();
    checkWatched();
    nextWatch = lastActivity + std::chrono::milliseconds(10);
  }
}

} // namespace transport
} // namespace tdx

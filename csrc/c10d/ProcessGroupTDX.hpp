// ProcessGroupTDX: the c10d::Backend behind torch.distributed's "tdx".
//
// Every collective is validated on the caller's thread (errors raise at the call, before
// anything is sent), then queued to the group's own worker thread, which runs it to
// completion over the process-wide transport with the group's timeout as its deadline.
// Point-to-point ops are posted directly and complete from the transport's callbacks,
// so a send never blocks a later receive.
//
// Tensors that are not contiguous CPU tensors (strided views, CUDA tensors) are staged
// through a contiguous host copy; CUDA tensors are first ordered after the caller's
// current stream with an event.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/registry.h"
#include "c10d/DeviceOps.hpp"
#include "c10d/FlightRecorder.hpp"
#include "c10d/GroupChannel.hpp"
#include "c10d/WorkTDX.hpp"
#include "transport/peer_memory/host_window.h"
#include "transport/ucx/ucx_transport.h"

namespace tdx {

// What one op may set apart from its group's defaults (ProcessGroupTDX::enqueue): its
// own time limit (0: the group's) and whether ranks compare fingerprints before it.
struct OpLimits {
  std::chrono::milliseconds timeout{0};
  bool fingerprinted = true;
  // Which side's shapes the fingerprint compares. A list op's per-rank side differs by
  // rank with uneven blocks (all_gather's input, reduce_scatter's output); the list, the
  // same on every rank, says everything the wire needs.
  bool fingerprintInputs = true;
  bool fingerprintOutputs = true;
  // False: a failure of this op on this rank is not told to the peers (the monitored
  // barrier's other ranks leave that to rank 0, whose error names the missing ranks).
  bool tellsPeers = true;
  // The collective the op is on the wire, where its OpType does not say (COALESCED).
  std::optional<algorithms::Collective> collective;
};

// Ids of destroyed groups that this process holds for good (their messages may still
// wait in a transport; see GroupIds::retire), for tests and diagnostics.
std::vector<uint32_t> groupIdsHeldForGood();

class ProcessGroupTDX : public c10d::Backend {
 public:
  ProcessGroupTDX(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  c10::intrusive_ptr<c10d::Backend::Options> options,
                  std::vector<int64_t> globalRanks);
  ~ProcessGroupTDX() override;

  const std::string getBackendName() const override {
    return "tdx";
  }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    return options_;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;

  // Collectives.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // all_reduce of `input` into `output` (torchdist_ext.all_reduce_into): `input` is left
  // as it was, and the shared-memory algorithms fold the copy into their own traffic.
  // `output` may be `input` itself.
  c10::intrusive_ptr<c10d::Work> allreduceInto(const at::Tensor& output,
                                               const at::Tensor& input,
                                               const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  // The single-tensor gather (dist.gather_single): the root's output holds world_size
  // inputs back to back. Declared without `override`: the virtual is newer than some of
  // the torch releases this source builds against, where it is simply never called.
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input,
                                               const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Blocks until every rank has reported to rank 0 within opts.timeout (the group's when
  // unset); rank 0 raises naming the first rank that did not (all of them with
  // waitAllRanks), the others raise when rank 0 does not release them. Like any failed
  // op, a failure breaks the group.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  // Point-to-point.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;

  // Coalescing: ops between start and end complete as one Work.
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Splitting (split_group, DeviceMesh with device_id).
  bool supportsSplitting() const override {
    return true;
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  // The last ops of this group (TDX_FLIGHT_OPS of them), oldest first.
  std::vector<FlightEntry> flightRecord() const;
  // Logs the newest entries of the flight record up to the failed op's (`failedId`;
  // none: the newest), and writes all of it under TDX_DUMP_DIR when that is set.
  // `shownAbove`: the error the log line before it gave.
  void dumpFlightRecord(const std::string& reason, const std::string& shownAbove = "",
                        uint64_t failedId = UINT64_MAX) const;

  // Ops that ran through same-host peer memory (tests check the fast path is taken).
  uint64_t peerOpsRun() const {
    return peer_ ? peer_->opsRun() : 0;
  }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }

  void shutdown() override;
  void abort() override;

  // The algorithm for one op of this group (on the worker thread, inside the op): the
  // registry's choice, with the shared-memory window it needs (created on first use,
  // collectively). A shared-memory choice falls back to the cheapest message algorithm
  // when the window cannot be had, on every rank alike.
  struct Selected {
    const algorithms::Algorithm* algorithm = nullptr;
    transport::HostWindow* window = nullptr;  // shared-memory algorithms only
    transport::WaitContext wait;
  };
  Selected select(algorithms::Collective c, double bytes, GroupChannel& ch, const char* what);
  // Whether rooted ops on messages send with acknowledgement (TDX_ROOT_CHECK; see
  // GroupChannel::setAcknowledgedSends).
  bool acknowledgesRootedSends() const {
    return acknowledgeRooted_;
  }
  // Ranks that run one part of an op (its sequence number and which of its choices, see
  // select()) different ways. Each throws when rank `peer` announced another way for the
  // running op's part than this rank's (choice_): in the window when the group has one,
  // else through the store, where this rank first announces its own. Called only by
  // waits that have stalled.
  void checkPeerWay(int peer) const;
  void checkPeerWayInStore(int peer);
  // For waits of a shared-memory algorithm (or of the window's set-up) on rank `peer`:
  // throws when `peer` runs the op on messages instead, seen by its message for the op
  // waiting here unreceived. A rank whose role only sends (a broadcast root) never
  // stalls to announce its way, so its messages are what tells.
  void checkMessagesFrom(const GroupChannel& ch, int peer);
  // A rank that refuses its pin for a part of an op says so as it would announce its way,
  // so that peers whose pins let them run it stop waiting for it.
  void announceRefusal(uint64_t part);
  // Whether op `seq` announces its way through the store (the group has no window).
  bool storeAnnounces(uint64_t seq) const;
  // The store prefix of the ranks' way keys (the rank's number follows).
  std::string wayKeys() const;

  // "[tdx r<rank>/<size> pg=<name>]": the prefix of every message of this group.
  std::string prefix() const;
  const std::string& groupName() const {
    return groupName_;
  }
  // The id in every tag the group's messages carry (a hash of its name).
  uint32_t tagId() const {
    return groupId_;
  }
  // Where the group's ranks are, as every rank of it agreed at creation.
  const algorithms::Placement& placement() const {
    return placement_;
  }
  // What this group would run for an op of `bytes` now: its size, placement and cost
  // model (its rank 0's), and the algorithms pinned at this moment.
  algorithms::Choice predict(algorithms::Collective c, double bytes) const;

 private:
  using DeviceBody = std::function<void(GroupChannel&, DeviceContext&)>;
  // Tries an op on the same-host CUDA peer-memory path; false: every rank stages instead.
  using PeerAttempt = std::function<bool(PeerMemory&, GroupChannel&, DeviceContext&)>;

  struct Task {
    c10::intrusive_ptr<WorkTDX> work;
    std::function<void(GroupChannel&)> body;  // host path: staged, synchronous
    DeviceBody deviceBody;                    // may leave work on the backend stream
    uint64_t seq = 0;
    std::vector<at::Tensor> keepAlive;
    std::shared_ptr<c10::Event> readyEvent;  // recorded on the caller's stream (CUDA)
    uint64_t flightId = 0;
    std::string fingerprint;  // checked across ranks before the op when enabled
    // The pinned algorithms when the op was issued: set_algorithm between issue and run
    // must not change it on one rank only.
    std::shared_ptr<const algorithms::Pins> pins;
    std::chrono::milliseconds timeout{0};  // the op's own limit; 0: the group's
    // False for an op whose purpose is finding the ranks that did not call it (the
    // monitored barrier): a fingerprint exchange first would time out without naming them.
    bool fingerprinted = true;
    bool tellsPeers = true;  // see OpLimits
    algorithms::Collective collective{};  // named in the op's tags (setCollective)
    size_t elementBytes = 0;  // see GroupChannel::setElementBytes
    uint32_t detailCode = 0;  // see GroupChannel::setDetailCode
    int detailRoot = -1;
  };

  // Queues a collective; `body` runs on the worker thread with the op's channel.
  // `writesOutputs` false: this rank only reads `outputs` (a broadcast's root, a reduce's
  // other ranks), which then need not be writable.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const std::string& what,
                                         std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs,
                                         std::function<void(GroupChannel&)> body,
                                         PeerAttempt peerAttempt = nullptr,
                                         bool writesOutputs = true,
                                         OpLimits limits = OpLimits{});
  c10::intrusive_ptr<c10d::Work> pointToPoint(bool isSend, at::Tensor tensor, int peer,
                                              int tag);
  void registerWork(const c10::intrusive_ptr<WorkTDX>& work);
  void runLoop();
  void runTask(Task& task);
  // Records a failed op: its error, the flight record and the log. `refused`: a pin that
  // cannot run, refused by every rank before any step, which leaves the group usable;
  // anything else marks the group broken and dumps the flight record.
  void handleFailure(Task& task, const std::string& what, const std::string& why,
                     uint32_t steps, const std::string& path, bool refused,
                     std::exception_ptr& error);
  void checkFingerprint(GroupChannel& ch, const std::string& mine);
  // Root (-1: none) and reduce op (null: none) of the next enqueue() on this thread: the
  // detail code of its tags, and its fingerprint when fingerprints are checked.
  void noteFingerprint(int root, const Reduction* red) const;
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(const std::string& ctx, const at::Tensor& t,
                                                 const c10d::AllreduceOptions& opts);
  void stopWorker(const std::string& reason);
  void shutdownLocked();
  // Shutdown's goodbye: tell every live peer this rank is done with the group and, when
  // `awaitPeers`, wait (bounded) until each has said the same.
  void sayGoodbye(bool awaitPeers);
  std::chrono::milliseconds timeout() const;
  std::string describe(const char* op, uint64_t seq, const std::vector<at::Tensor>& ts) const;
  // `ranks`: rankNote_ of the group, so the ranks the message names can be found.
  static std::exception_ptr wrapError(const std::string& what, const std::string& message,
                                      const std::string& ranks);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend::Options> options_;
  std::atomic<int64_t> timeoutMs_;  // options_->timeout, for threads other than the caller's
  std::string groupName_;
  int64_t incarnation_ = 0;  // the store generation (constructor): this instance's keys
  // The running op's latest choice (select()), for the checks above; the worker's only.
  struct WayChoice {
    uint64_t part = 0;
    uint16_t way = 0;  // the algorithm's index in the registry plus one
    bool announced = false;  // in the store
    std::chrono::steady_clock::time_point storeCheckAt;  // the next store check
    int root = -1;  // the op's root (-1: none), announced in the store with the way
  };
  WayChoice choice_;
  // checkMessagesFrom's two looks: a peer's message for the op must still be waiting at
  // a check after the one that first saw it (one per member, for choice_.part). Set-up
  // needs the second look: a peer that went through it wrote its key before it sent,
  // and a key read just before that write must not count as the peer's absence.
  std::vector<uint8_t> messageSeen_;
  uint64_t messageSeenPart_ = ~uint64_t{0};
  // What the latest store read for checkPeerWayInStore found, written by the thread that
  // made it (store calls have no deadline, so the waiting thread never makes them).
  struct WayRead {
    std::mutex mu;
    bool busy = false;  // a read is in flight
    uint64_t part = 0;
    int peer = -1;
    uint16_t way = 0;  // what `peer` announced for `part` (0: nothing)
    int root = -1;     // and the root it named (-1: none)
    std::mutex writeMu;  // orders this rank's writes of its own key
    uint64_t written = 0;  // the latest part whose way this rank wrote
  };
  std::shared_ptr<WayRead> wayRead_ = std::make_shared<WayRead>();
  // Writes this rank's way for `part` under `key`, unless a later part's is written.
  static void writeWay(WayRead& read, c10d::Store& store, const std::string& key,
                       uint64_t part, uint16_t way, int root);
  uint64_t windowTriedSeq_ = 0;  // the op that tried to make the window (storeAnnounces)
  // This rank's latest choices (part, way), for peers that announce an earlier part.
  struct PastWay {
    uint64_t part = 0;
    uint16_t way = 0;
  };
  std::array<PastWay, 8> pastWays_{};
  size_t pastNext_ = 0;
  // This rank's way for `part` among its latest choices, comparing the bits in `mask`
  // (a window announcement keeps the low ones); 0 when it has none.
  uint16_t pastWay(uint64_t part, uint64_t mask) const;
  std::vector<int64_t> globalRanks_;
  // For a group whose ranks are not the global ones: which global rank each is, added to
  // its errors (which name ranks of the group); "" otherwise. Shared, so a point-to-point
  // op's completion holds it without a copy per op.
  std::shared_ptr<const std::string> rankNote_ = std::make_shared<const std::string>();
  // The worker's running op and where it stalled, shared with every collective's work.
  std::shared_ptr<RunningOp> runningOp_ = std::make_shared<RunningOp>();
  uint32_t groupId_;
  // Dropped at shutdown, which may run on another thread (abort from a watchdog) while a
  // caller's thread is in a point-to-point op: that thread takes its own reference under
  // transportMu_, which the drop takes too. The worker thread, joined first, reads it
  // freely.
  std::shared_ptr<transport::UcxTransport> transport_;
  std::mutex transportMu_;
  std::shared_ptr<transport::UcxTransport> liveTransport();
  std::vector<int> endpoints_;  // group rank -> transport endpoint
  // The same, for p2p completions, which may run after the group is gone.
  std::shared_ptr<const std::vector<int>> sharedEndpoints_;
  std::unique_ptr<PeerMemory> peer_;  // same-host CUDA path; null without CUDA

  // Whether the group's ranks share a host (same boot, mount and pid namespaces), which
  // prices its messages as same-host ones and, unless TDX_SHM=0, lets shared-memory
  // algorithms run; and the cost model every rank of the group uses (rank 0's), so all
  // make the same choices.
  algorithms::Placement placement_;
  // CPUs the group's ranks on this host may run on together (how many can each hold a
  // CPU of their own within their affinity masks, capped by a cgroup quota): decides
  // crowding, UCX's rendezvous threshold (for the group that starts the transport) and
  // whether window waits poll.
  int hostCpus_ = 1;
  algorithms::CostModel costModel_;
  // The running op's pins (Task::pins); the worker thread's alone.
  const algorithms::Pins* taskPins_ = nullptr;
  transport::HostWindow* hostWindow(const transport::WaitContext& wc);
  transport::HostWindow* setUpWindow(const transport::WaitContext& wc);  // hostWindow's first call
  // Waits until the store holds `key` + every rank (or `key` alone when it does not end
  // in '/'), bounded by the group timeout; `step` says what a missing rank failed to do.
  void setupWait(const std::string& key, const char* step);
  // Throws when a rank of `late` (whose keys are missing) is known lost, or, at the set-up
  // deadline, when any is late; the message names `step` and the store key.
  void setupLate(const std::vector<int>& late, const std::string& key, const char* step) const;
  std::chrono::steady_clock::time_point setupDeadline_;
  // `owner`: the group rank that sets `key`, named when it does not in time.
  std::vector<uint8_t> storeGetWithin(const std::string& key, int owner,
                                      const transport::WaitContext& wc);
  std::unique_ptr<transport::HostWindow> window_;
  int windowState_ = 0;  // 0: not tried, 1: ready, -1: unavailable
  // What the window turned out to be, for predict() on other threads: 0 not known yet,
  // 1 ready, 2 ready without cross-memory reads, -1 could not be made.
  std::atomic<int> windowOutcome_{0};

  // Lent to each op's channel in turn; ops run one at a time, on the worker thread.
  ScratchBuffer scratch_;
  // Shared with point-to-point completions, which record how their op ended and may run
  // after the group is gone.
  std::shared_ptr<FlightRecorder> flight_;
  // TDX_DEBUG=DETAIL or TORCH_DISTRIBUTED_DEBUG=DETAIL: ranks compare each collective's
  // fingerprint (op, dtype, shapes, root, reduce op) before running it.
  bool checkFingerprints_ = false;
  bool acknowledgeRooted_ = true;  // TDX_ROOT_CHECK (acknowledgesRootedSends())
  std::atomic<uint64_t> seq_{0};
  // Set at shutdown, or when a peer reports a mismatch: ops in flight stop waiting. Shared
  // so that a completion outliving the group may still set it.
  std::shared_ptr<std::atomic<bool>> abortFlag_ = std::make_shared<std::atomic<bool>>(false);
  std::atomic<bool>& aborted_ = *abortFlag_;
  // abort() was called: unlike a peer's report, shutdown then listens for no goodbye.
  std::atomic<bool> abortCalled_{false};

  // A group is broken after an op failed, a member's connection was lost or device work
  // stalled: every later op, collective or point-to-point, is refused. Any thread may
  // mark or ask; the first reason is the one reported.
  void markBroken(const std::string& reason);
  // Empty while the group is usable, else why it is not. Looks at this group's endpoints
  // only when the transport's failure count changed (one atomic load otherwise).
  // The worker thread and shutdown (before it drops transport_) use the group's transport;
  // a caller's thread passes its own reference (liveTransport()).
  std::string brokenReason();
  std::string brokenReason(transport::UcxTransport& ucx);
  std::atomic<bool> broken_{false};
  std::mutex brokenMu_;       // guards brokenReason_ and the endpoint look-up
  std::string brokenReason_;
  // The transport's failedEndpoints() when this group's endpoints were last looked at.
  std::atomic<uint64_t> failuresSeen_{0};

  // A failure seen outside the group's thread: a point-to-point op that failed (its
  // completion may run after the group is gone, so this is shared with it), or a
  // peer's notice of a mismatch. Either makes the group broken: a timed-out receive's
  // message could otherwise still arrive and fill a later receive with the wrong data.
  struct Fault {
    std::mutex mu;
    std::string text;  // the first failure wins
    std::atomic<bool> happened{false};
    std::atomic<bool> cutShort{false};  // ops in flight were aborted for it
    // The group has shut down: its id may go to a later group, so nothing may be sent
    // under it any more (a point-to-point completion can run after the group is gone).
    std::atomic<bool> closed{false};
    std::shared_ptr<std::atomic<bool>> abortFlag;

    // `abort`: also stop the ops in flight (a mismatch notice: they cannot succeed).
    // True for the first fault recorded, whose thread tells the peers (once).
    bool record(const std::string& why, bool abort);
    std::string read();
  };
  std::shared_ptr<Fault> fault_;

  // Point-to-point requests in flight. Once the group is broken (a member lost, say) the
  // worker cancels them: one may wait on a live peer that will never send, since that
  // peer's own ops are refused now. The count is shared with the completions.
  std::mutex p2pMu_;
  std::vector<std::weak_ptr<transport::Request>> p2pRequests_;
  size_t p2pPruneAt_ = 64;  // sweep finished requests out of p2pRequests_ at this size
  // Set by shutdown before it cancels p2pRequests_: an op posted after that cancels its
  // own request, or it would stay posted past the group.
  bool p2pClosed_ = false;
  std::shared_ptr<std::atomic<int>> p2pInFlight_ = std::make_shared<std::atomic<int>>(0);
  void cancelPointToPointIfBroken();
  // Ends every point-to-point request still in flight with `reason`. Those it may not
  // end (UCX cancels only receives it has not matched) are collected in `unended` when
  // given: the sends with `sends`, the any-source receives with `anySourceReceives`.
  void cancelPointToPoint(const std::string& reason,
                          std::vector<std::weak_ptr<transport::Request>>* unended = nullptr,
                          bool sends = false, bool anySourceReceives = true);
  // Any-source receives of a broken group that a cancel did not end: UCX had matched them
  // to a message a lost rank was part way through sending, and only the group timeout
  // would end them. Each is abandoned once its time has come.
  std::vector<std::pair<std::weak_ptr<transport::Request>, std::chrono::steady_clock::time_point>>
      p2pUnended_;
  // Ends those of `rs` still pending (Transport::abandon).
  void abandonRequests(const std::vector<std::weak_ptr<transport::Request>>& rs,
                       const std::string& reason);

  // Under fingerprint checks, a point-to-point mismatch ends the group on every rank, not
  // only on the receiver that saw it: the receiver sends each member a notice naming both
  // calls, and a rank that gets one (or sent it) aborts its ops in flight and refuses
  // later ones with that text.
  transport::RequestPtr noticeRecv_;
  void listenForMismatchNotices();

  // Each member's goodbye (sayGoodbye) carries how many collectives it issued on the
  // group. It is received from the group's start, not only at this rank's shutdown, so
  // a member that shut the group down without calling an op this rank waits in (or
  // will run) fails that op at once, naming the member, instead of at the group timeout
  // or that member's exit. Shared with the receives' completions, which may outlive the
  // group.
  // A goodbye is this group instance's token (a hash of its name and incarnation: a
  // goodbye left unreceived by an earlier group with the same id must not count), the
  // count of collectives, whether the member listens for the others' goodbyes, then why
  // the member gave the group up, if it had (a member that leaves because a rank died
  // must not be taken for the cause).
  struct Goodbyes {
    static constexpr size_t kWords = 3;     // token, collectives issued, listens
    static constexpr size_t kBytes = 1024;  // a goodbye at most: the words and the reason
    Goodbyes(int size, uint64_t token)
        : token(token), lastSeq(size), listened(size), stale(size), reason(size),
          message(size * kBytes, 0) {
      for (auto& s : lastSeq) s.store(kStayed);
      for (auto& s : listened) s.store(false);
      for (auto& s : stale) s.store(false);
    }
    static constexpr uint64_t kStayed = ~uint64_t{0};  // no goodbye yet
    const uint64_t token;
    std::vector<std::atomic<uint64_t>> lastSeq;  // by group rank
    // By group rank, written before its lastSeq: the member listened for this rank's
    // goodbye when it left (until all came, or briefly: kGoodbyeCourtesyWait). One that
    // did not (abort() was called) may have stopped its transport already: a goodbye
    // sent to it would reach shared memory it has removed (UCX logs "shmat failed").
    std::vector<std::atomic<bool>> listened;
    // The least of lastSeq: what each op checks, one load instead of one per member.
    std::atomic<uint64_t> firstLeft{kStayed};
    // The receive took another group's goodbye: shutdown posts a plain one again.
    std::vector<std::atomic<bool>> stale;
    std::vector<std::string> reason;  // by group rank; written before its lastSeq
    std::vector<char> message;        // the receives' buffers, kBytes each
    std::vector<char> late;           // shutdown's receives' buffers, made only if needed
    std::atomic<uint64_t> running{0};            // the op the worker runs now (0: none)
    std::vector<transport::RequestPtr> receives; // by group rank (null for this rank)
  };
  std::shared_ptr<Goodbyes> goodbyes_;
  void listenForGoodbyes();
  uint64_t goodbyeToken() const;
  // Why op `seq` cannot run because a member has shut the group down before issuing
  // it, or "" when none has.
  std::string leftBefore(uint64_t seq) const;
  // Sends `text` to every other member's notice receive: they give the group up at once,
  // with this as the reason, instead of waiting for this rank until their timeout.
  void tellPeers(const std::string& text);
  // After op `seq` timed out on this rank: says so in the store, and names the ranks that
  // said the same within a short grace (they reached the op) and those that did not.
  std::string timeoutNote(uint64_t seq);

  std::mutex enqueueMu_;  // held from taking a sequence number to queueing the op
  std::mutex queueMu_;
  std::condition_variable queueCv_;
  std::deque<Task> queue_;
  std::atomic<int> queued_{0};  // queue_.size(), readable without the lock
  std::atomic<bool> running_{false};  // the worker is running an op
  // The worker sleeps with no deadline (no point-to-point op to watch). Set under
  // queueMu_ before it checks the in-flight count; a point-to-point op reads it after
  // raising the count, so one of the two sees the other (both seq_cst) and only an op
  // that finds the worker in that sleep pays for the lock and the wake-up.
  std::atomic<bool> workerAsleep_{false};
  bool stopping_ = false;
  std::thread worker_;
  std::mutex shutdownMu_;
  bool shutDown_ = false;

  std::mutex coalesceMu_;
  c10::intrusive_ptr<WorkTDX> coalesced_;

  friend class CollectiveBuilder;
};

} // namespace tdx

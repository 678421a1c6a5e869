// The guarded communicator: the host communicator's operations inside guard windows.
#include "comm/guarded_communicator.h"

#include <utility>

namespace foldpar {
namespace {

// A request on the host communicator that holds the guard open until it has completed.
class GuardedRequest final : public CommRequestImpl {
 public:
  GuardedRequest(CommRequest inner, GuardedAllocator& guard) : inner_(std::move(inner)), guard_(&guard) {
    guard_->open();
  }
  ~GuardedRequest() override { finish(); }

  Status wait() override {
    Status s = inner_.wait();
    finish();
    return s;
  }
  Status test(bool* done) override {
    Status s = inner_.test(done);
    if (*done) finish();
    return s;
  }

 private:
  void finish() {
    if (guard_ != nullptr) guard_->close();
    guard_ = nullptr;
  }
  CommRequest inner_;
  GuardedAllocator* guard_;
};

class GuardedCommunicator final : public Communicator {
 public:
  GuardedCommunicator(Communicator& host, std::unique_ptr<Communicator> owned_host, GuardedAllocator& guard)
      : Communicator(host.rank(), host.size(), host.name(), host.world_ranks()),
        host_(host),
        owned_host_(std::move(owned_host)),
        guard_(guard) {}

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    std::unique_ptr<Communicator> part = host_.split(color, key, std::move(name));
    if (part == nullptr) return nullptr;
    Communicator& ref = *part;
    return std::make_unique<GuardedCommunicator>(ref, std::move(part), guard_);
  }

 protected:
  Status supports(const CommOp&) const override { return Status::ok_status(); }
  Status run_validated(const CommOp& op) override {
    GuardOpen window(&guard_);
    return host_.run(op);
  }
  CommRequest start_validated(const CommOp& op) override {
    GuardOpen window(&guard_);  // the start itself may read the buffers
    return CommRequest(std::make_unique<GuardedRequest>(host_.start(op), guard_));
  }

 private:
  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;
  GuardedAllocator& guard_;
};

}  // namespace

std::unique_ptr<Communicator> make_guarded_communicator(Communicator& host, std::unique_ptr<Communicator> owned_host,
                                                        GuardedAllocator& guard) {
  return std::make_unique<GuardedCommunicator>(host, std::move(owned_host), guard);
}

}  // namespace foldpar

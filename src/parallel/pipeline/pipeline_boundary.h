// StageBoundary: what crosses between neighbouring pipeline stages of one step
// (docs/composition.md section 2). Each TSP rank r of stage s sends its own rows [T, h]
// (T = B*S/D, the zigzag chunks it already holds) to the same TSP index r of stage s+1 (the
// pp communicator's rank s+1 of the group this rank is in) and receives their gradient back:
// shapes and dtype are static, known before the step, so nothing else is exchanged.
// Everything is non-blocking: a stage posts its send and the receive its next op needs
// together and waits only on receives, so no rank blocks in a send whose receive its peer
// posts later. Messages of one direction are in micro-batch order (the 1F1B schedule's), and
// the ones of a micro-batch are matched by that order.
// Interleaved (v chunks per rank, pipeline_schedule.h): local chunk c of rank s is global
// chunk g = c p + s; its input comes from rank s-1 mod p (chunk g-1), its output goes to rank
// s+1 mod p (chunk g+1), and gradients the other way. Each (direction, sending chunk) is its
// own message stream (an MPI tag), in micro-batch order within, so under pp=2, where both
// neighbours are one rank, no (chunk, micro-batch) can be taken for another.
// Per step and boundary: m v activations one way and m v gradients the other (less the ends
// of the chunk chain), each T*h*beta bytes: 2*m*v*B*(S/D)*h*beta in all.
// Side messages (set_side; a MoE model's routing statistics forward and the aux loss's
// gradient back, parallel/pipeline/pipeline_model.h): each activation and gradient may be
// followed by a fixed number of f64 values of its own, a second message posted right after
// it on both ends (contiguous stages: on the same stream, so in-order matching pairs them;
// interleaved: on a stream of its own per (direction, sending chunk)), sent and kept
// together with it.
// Every transfer carries its purpose for the watchdog (CommPurpose): a rank that never
// arrives is named by stage, world rank, model-axis index, micro-batch and direction.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>

#include "comm/communicator.h"
#include "parallel/step_timer.h"
#include "tensor/tensor.h"

namespace foldpar {

// What crosses: a micro-batch's activation (forward, to stage s+1) or its gradient
// (backward, to stage s-1).
enum class BoundaryDirection { kActivation, kGradient };

// Fault injection for tests (as CheckpointHooks): library code never reads the environment
// for it. Called on the main thread.
struct BoundaryHooks {
  // Before micro-batch `i`'s activation or gradient is sent; may sleep (a stalled rank).
  std::function<void(BoundaryDirection direction, int i)> before_send;
};

// Where this rank is on the model axis of its stage, for the watchdog's messages: every
// rank of a pp group has the same index on that axis. `axis` must outlive the boundary.
struct BoundaryPlace {
  const char* axis = "tsp";
  int index = 0;
};

class StageBoundary {
 public:
  // pp: the pipeline communicator (rank = stage); rows x h elements of `dtype` per message.
  // `timer` counts the time blocked on receives. Both borrowed for the step.
  // `chunks`: v, the local chunks of each rank (1: contiguous stages, untagged messages).
  StageBoundary(Communicator& pp, int64_t rows, int64_t h, DType dtype, StepTimer& timer, int chunks = 1);
  // Optional, before the first transfer: how messages name this rank, and test hooks
  // (borrowed; null: none).
  void set_place(BoundaryPlace place) { place_ = place; }
  void set_hooks(const BoundaryHooks* hooks) { hooks_ = hooks; }
  // Optional, before the first transfer: f64 values that go with every activation and with
  // every gradient (0: none); then send_* must be given, and take_* hands back, that many.
  void set_side(int64_t activation_values, int64_t gradient_values) {
    side_[0] = activation_values;
    side_[1] = gradient_values;
  }
  StageBoundary(const StageBoundary&) = delete;
  StageBoundary& operator=(const StageBoundary&) = delete;
  ~StageBoundary();  // FP_CHECKs that finish() ran: a send left in flight is a bug

  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  // Whether local chunk c is the model's first chunk (it embeds) or its last (the head).
  bool first_chunk(int c) const { return global_chunk(c) == 0; }
  bool last_chunk(int c) const { return global_chunk(c) == stages_ * chunks_ - 1; }

  // Posts the receive of micro-batch i's activation for local chunk c from the previous
  // chunk (the first chunk: no receive) or of its gradient from the next (the last: none), once.
  void post_activation_recv(int i, int c = 0);
  void post_gradient_recv(int i, int c = 0);
  // Waits for what the post brought (posting it first if needed): [rows, h]; with side
  // values (set_side) they go into *side, f64 [n] (null: dropped).
  Tensor take_activation(int i, int c = 0, Tensor* side = nullptr);
  Tensor take_gradient(int i, int c = 0, Tensor* side = nullptr);
  // Starts sending chunk c's output [rows, h] of micro-batch i to the next chunk, or its
  // input gradient to the previous one. The tensor is kept until a fixed point of the
  // schedule, not until MPI happens to report the send done, so a stage's memory is the same
  // in every run (and the plan's dry run predicts it exactly): until p more sends of its
  // direction are posted (then the oldest is waited, which cannot block under 1F1B: see the
  // .cc; interleaved: pipeline_schedule_test's simulation of every rank) or finish().
  // `side`: the f64 [n] values of set_side (undefined when n is 0).
  void send_activation(int i, Tensor x, int c = 0, Tensor side = Tensor());
  void send_gradient(int i, Tensor dx, int c = 0, Tensor side = Tensor());
  // Advances the transfers in flight; never blocks, releases nothing.
  void progress();
  // Waits for every send; every posted receive must have been taken.
  void finish();

 private:
  struct Transfer {
    Tensor buffer;
    CommRequest request;
    Tensor side;               // set_side's values (undefined: none)
    CommRequest side_request;
  };
  using Key = std::pair<int, int>;  // (local chunk, micro-batch)
  int global_chunk(int c) const { return c * stages_ + stage_; }
  // The stream of messages sent by global chunk g in `direction`: 0 without chunks; the
  // side values' streams (interleaved) after every chunk's (2 p v + 1 + ...).
  int tag(BoundaryDirection direction, int sender_chunk) const;
  int side_tag(BoundaryDirection direction, int sender_chunk) const;
  int64_t side_values(BoundaryDirection direction) const {
    return side_[direction == BoundaryDirection::kActivation ? 0 : 1];
  }
  // A transfer and its side message, if any: waited / advanced together.
  void wait(Transfer& t);
  static void poke(Transfer& t);
  void post_recv(std::map<Key, Transfer>& pending, int i, int c, BoundaryDirection direction);
  Tensor take(std::map<Key, Transfer>& pending, int i, int c, BoundaryDirection direction, Tensor* side);
  void send(std::deque<Transfer>& in_flight, Tensor t, Tensor side, int i, int c, BoundaryDirection direction);
  // "stage s (world rank w, tsp index r) never sent/received ... of micro-batch i ..."
  // (interleaved: "... (chunk g) ...", the chunk the message is for).
  CommPurpose purpose(bool receive, BoundaryDirection direction, int i, int peer, int for_chunk) const;

  Communicator& pp_;
  int stage_, stages_, chunks_;
  int64_t rows_, h_;
  DType dtype_;
  StepTimer& timer_;
  BoundaryPlace place_;
  const BoundaryHooks* hooks_ = nullptr;
  int64_t side_[2] = {0, 0};  // set_side: f64 values per activation, per gradient
  std::map<Key, Transfer> activations_in_, gradients_in_;  // by (chunk, micro-batch)
  std::deque<Transfer> to_next_, to_prev_;                  // sends kept, oldest first
};

}  // namespace foldpar

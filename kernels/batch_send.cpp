// The batch sender's native half: a thread of its own that writes a step's SSE frames to
// their sockets, so that the event loop's thread spends no time in send(2). See sender.py.
//
// One entry point (the code cache builds `kernel`), by `op`:
//   OPEN   -> out[0] = handle, out[1] = an eventfd the loop watches (readable: batches done)
//   SUBMIT    queue a batch of `n` records, back to back in `buf` (`size` bytes): a record is the
//             connection's id and descriptor (two native int64) and one HTTP/1.1 chunk,
//             "<size in hex>\r\n<size bytes>\r\n", the frame sent (its length is read from
//             its own header). The bytes are copied; the call returns at once
//   POLL   -> out[0] = batches done since the last poll, then per batch and in the order
//             submitted, one value per record: bytes of its frame sent, or -errno. At most
//             `n` values; a batch that does not fit stays for the next poll
//   RESUME    ints[0]: a connection whose frames were diverted may be sent to again
//   CLOSE     stop the thread (the batches queued are sent first), close the eventfd
//
// Per connection, frames go out in the order submitted. A frame that cannot be sent whole
// (the socket's buffer is full, or an error) marks its connection *diverted*: later frames of
// that connection are not sent either, until RESUME. The loop writes what was not sent
// through its own transport, in order, and resumes the connection once none of its frames is
// queued here any more.
#include <Python.h>  // first, as Python asks: the GIL is released while joining
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#else
#error "the batch sender needs Linux (eventfd, MSG_NOSIGNAL)"
#endif

namespace {

struct Entry {
    int64_t conn, fd, begin, len;  // the frame: data[begin, begin + len)
};

struct Batch {
    std::string data;
    std::vector<Entry> entries;
    std::vector<int64_t> results;
};

// The records of `data` (see SUBMIT). A record that does not parse ends the batch early:
// it and the ones after it get -EINVAL.
static void ae_parse(Batch& b, int64_t n) {
    const char* d = b.data.data();
    const int64_t size = (int64_t)b.data.size();
    int64_t at = 0;
    for (int64_t i = 0; i < n; ++i) {
        Entry e{-1, -1, 0, 0};
        if (at + 16 < size) {
            std::memcpy(&e.conn, d + at, 8);
            std::memcpy(&e.fd, d + at + 8, 8);
            int64_t p = at + 16, chunk = 0, digits = 0;
            for (; p < size && digits < 16; ++p, ++digits) {
                const char c = d[p];
                const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
                if (v < 0) break;
                chunk = chunk * 16 + v;
            }
            const int64_t end = p + 2 + chunk + 2;
            if (digits > 0 && p + 1 < size && d[p] == '\r' && d[p + 1] == '\n' && end <= size) {
                e.begin = at + 16;
                e.len = end - e.begin;
                at = end;
                b.entries.push_back(e);
                continue;
            }
        }
        break;
    }
    b.results.assign(n, -EINVAL);
}

struct Sender {
    int efd = -1;
    std::mutex mu;  // guards the fields up to `thread`; held only to move a batch or an id
    std::condition_variable cv;
    bool stopping = false;
    std::deque<std::unique_ptr<Batch>> queued, done;
    std::vector<int64_t> resumed;  // RESUME'd connections, for the thread to take
    std::thread thread;
    // The thread's own: connections whose frames go back unsent. Never locked, so that the
    // loop never waits on a thread preempted in the middle of a batch.
    std::unordered_set<int64_t> diverted;

    void run() {
        // Woken by each SUBMIT, the thread must not preempt the loop's thread that woke it
        // (on a busy machine the loop would then sit out the whole batch): SCHED_BATCH
        // threads do not preempt on wakeup. Best effort.
        sched_param none{};
        none.sched_priority = 0;
        pthread_setschedparam(pthread_self(), SCHED_BATCH, &none);
        std::vector<int64_t> resume;
        for (;;) {
            std::unique_ptr<Batch> batch;
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [this] { return stopping || !queued.empty(); });
                if (queued.empty()) return;
                batch = std::move(queued.front());
                queued.pop_front();
                resume.swap(resumed);
            }
            // A connection is resumed only once none of its frames is queued: every batch
            // taken from now on may send to it.
            for (const int64_t conn : resume) diverted.erase(conn);
            resume.clear();
            send_all(*batch);
            {
                std::lock_guard<std::mutex> lock(mu);
                done.push_back(std::move(batch));
            }
            const uint64_t one = 1;
            ssize_t w;
            do { w = write(efd, &one, sizeof one); } while (w < 0 && errno == EINTR);
        }
    }

    void send_all(Batch& b) {
        const int64_t n = (int64_t)b.entries.size();
        for (int64_t i = 0; i < n; ++i) {
            const int64_t conn = b.entries[i].conn, fd = b.entries[i].fd, len = b.entries[i].len;
            const char* p = b.data.data() + b.entries[i].begin;
            b.results[i] = 0;
            if (diverted.count(conn)) continue;  // sent: 0, all of it goes through the loop
            int64_t sent = 0;
            int err = 0;
            while (sent < len) {
                const ssize_t r = send((int)fd, p + sent, len - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
                if (r > 0) { sent += r; continue; }
                if (r < 0 && errno == EINTR) continue;
                if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
                break;
            }
            b.results[i] = err ? -err : sent;
            if (sent < len) diverted.insert(conn);
        }
    }
};

// Never destroyed: a sender the process did not close must not end it at exit (a joinable
// std::thread's destructor would).
std::mutex& registry_mu = *new std::mutex;
std::map<int64_t, Sender*>& registry = *new std::map<int64_t, Sender*>;
int64_t next_handle = 1;

Sender* find(int64_t handle) {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find(handle);
    return it == registry.end() ? nullptr : it->second;
}

}  // namespace

enum { AE_OPEN = 0, AE_SUBMIT = 1, AE_POLL = 2, AE_RESUME = 3, AE_CLOSE = 4 };

extern "C" void kernel(int64_t op, int64_t handle, const int64_t* ints, const uint8_t* buf,
                       int64_t n, int64_t size, int64_t* out) {
    if (op == AE_OPEN) {
        auto s = std::make_unique<Sender>();
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (s->efd < 0) { out[0] = -errno; return; }
        Sender* raw = s.release();
        raw->thread = std::thread([raw] { raw->run(); });
        std::lock_guard<std::mutex> lock(registry_mu);
        out[0] = next_handle;
        out[1] = raw->efd;
        registry[next_handle++] = raw;
        return;
    }
    Sender* s = find(handle);
    if (s == nullptr) { if (out) out[0] = -EBADF; return; }
    if (op == AE_SUBMIT) {
        auto b = std::make_unique<Batch>();
        b->data.assign(reinterpret_cast<const char*>(buf), size);
        ae_parse(*b, n);
        {
            std::lock_guard<std::mutex> lock(s->mu);
            s->queued.push_back(std::move(b));
        }
        s->cv.notify_one();
    } else if (op == AE_POLL) {
        uint64_t count;
        ssize_t r;
        do { r = read(s->efd, &count, sizeof count); } while (r < 0 && errno == EINTR);
        int64_t batches = 0, used = 0;
        std::lock_guard<std::mutex> lock(s->mu);
        while (!s->done.empty()) {
            const Batch& b = *s->done.front();
            const int64_t m = (int64_t)b.results.size();
            if (used + m > n) break;
            std::memcpy(out + 1 + used, b.results.data(), m * sizeof(int64_t));
            used += m;
            ++batches;
            s->done.pop_front();
        }
        out[0] = batches;
        if (!s->done.empty()) {  // left for the next poll: make the eventfd readable again
            const uint64_t one = 1;
            ssize_t w;
            do { w = write(s->efd, &one, sizeof one); } while (w < 0 && errno == EINTR);
        }
    } else if (op == AE_RESUME) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->resumed.push_back(ints[0]);
    } else if (op == AE_CLOSE) {
        std::unique_ptr<Sender> owned(s);
        {
            std::lock_guard<std::mutex> lock(registry_mu);
            registry.erase(handle);
        }
        {
            std::lock_guard<std::mutex> lock(owned->mu);
            owned->stopping = true;
        }
        owned->cv.notify_one();
        {
            // Sending what is queued takes no GIL; release it so that nothing waits on us.
            PyThreadState* state = PyGILState_Check() ? PyEval_SaveThread() : nullptr;
            owned->thread.join();
            if (state) PyEval_RestoreThread(state);
        }
        close(owned->efd);
    }
}

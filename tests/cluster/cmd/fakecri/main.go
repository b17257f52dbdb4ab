// fakecri serves Kubernetes' own fake CRI runtime and image service on a unix
// socket. It runs in a process of its own, so its sandboxes and containers
// outlive a kubelet restart the way a real runtime's do.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	fake "k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
)

// withStats is the fake runtime whose containers have stats: zero CPU and
// memory usage, no writable layer. The fake's own ContainerStats and
// ListContainerStats answer only what SetFakeContainerStats was given, and the
// kubelet's CRI stats provider builds a pod's stats, volume stats included, only
// from its containers' stats (pkg/kubelet/stats/cri_stats_provider.go,
// listPodStatsPartiallyFromCRI): without them it lists no pod, and the
// kubelet_volume_stats_* collector has nothing to report.
type withStats struct {
	*fake.RemoteRuntime
}

func zeroStats(c *kubeapi.Container) *kubeapi.ContainerStats {
	now := time.Now().UnixNano()
	return &kubeapi.ContainerStats{
		Attributes: &kubeapi.ContainerAttributes{
			Id: c.Id, Metadata: c.Metadata, Labels: c.Labels, Annotations: c.Annotations,
		},
		Cpu:    &kubeapi.CpuUsage{Timestamp: now, UsageCoreNanoSeconds: &kubeapi.UInt64Value{}},
		Memory: &kubeapi.MemoryUsage{Timestamp: now, WorkingSetBytes: &kubeapi.UInt64Value{}},
	}
}

func (f withStats) ListContainerStats(ctx context.Context, req *kubeapi.ListContainerStatsRequest) (*kubeapi.ListContainerStatsResponse, error) {
	filter := req.GetFilter()
	containers, err := f.RuntimeService.ListContainers(ctx, &kubeapi.ContainerFilter{
		Id: filter.GetId(), PodSandboxId: filter.GetPodSandboxId(), LabelSelector: filter.GetLabelSelector(),
	})
	if err != nil {
		return nil, err
	}
	reply := &kubeapi.ListContainerStatsResponse{}
	for _, c := range containers {
		reply.Stats = append(reply.Stats, zeroStats(c))
	}
	return reply, nil
}

func (f withStats) ContainerStats(ctx context.Context, req *kubeapi.ContainerStatsRequest) (*kubeapi.ContainerStatsResponse, error) {
	containers, err := f.RuntimeService.ListContainers(ctx, &kubeapi.ContainerFilter{Id: req.ContainerId})
	if err != nil {
		return nil, err
	}
	if len(containers) == 0 {
		return nil, status.Errorf(codes.NotFound, "no container %q", req.ContainerId)
	}
	return &kubeapi.ContainerStatsResponse{Stats: zeroStats(containers[0])}, nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: fakecri unix:///path/to/socket")
		os.Exit(2)
	}
	runtime := withStats{fake.NewFakeRemoteRuntime()}
	// The kubelet refuses an image without an id and a size; the fake's pulls have the
	// name as the id and this size.
	runtime.ImageService.SetFakeImageSize(1 << 20)
	// What the fake's Start does, with this server: its own serves the fake without stats.
	runtime.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{
		Conditions: []*kubeapi.RuntimeCondition{
			{Type: kubeapi.RuntimeReady, Status: true},
			{Type: kubeapi.NetworkReady, Status: true},
		},
	}
	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, runtime)
	kubeapi.RegisterImageServiceServer(server, runtime)
	listener, err := util.CreateListener(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
	go server.Serve(listener)
	fmt.Println("fakecri: serving", os.Args[1])
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	server.Stop()
}

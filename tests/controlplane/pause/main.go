// The real node's pod sandbox process (what a cluster pulls as registry.k8s.io/pause, which no
// registry here serves): it holds the pod's namespaces, reaps orphans as PID 1 and exits on
// SIGINT or SIGTERM. Built by build.sh; cluster.py makes it the image containerd's CRI uses.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	child := make(chan os.Signal, 16)
	signal.Notify(child, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-child:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
